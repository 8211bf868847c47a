"""Vulkan device discovery and capabilities, read with the `vulkan` (cffi) package.

Kernel variants are chosen from these facts (subgroup size, shared memory, coopmat shapes,
16-bit/8-bit support), never from the vendor name. `vkflash info` prints all of it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import vulkan as vk

from vkflash.errors import DeviceError

_TYPES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
_COMPONENT = {
    vk.VK_COMPONENT_TYPE_FLOAT16_KHR: "f16",
    vk.VK_COMPONENT_TYPE_FLOAT32_KHR: "f32",
    vk.VK_COMPONENT_TYPE_SINT8_KHR: "s8",
    vk.VK_COMPONENT_TYPE_UINT8_KHR: "u8",
    vk.VK_COMPONENT_TYPE_SINT32_KHR: "s32",
    vk.VK_COMPONENT_TYPE_UINT32_KHR: "u32",
}
# bf16 has no enum in this `vulkan` release; its value from the registry.
_COMPONENT[1000141000] = "bf16"


@dataclass(frozen=True)
class CoopmatShape:
    """One cooperative-matrix shape the device offers: A(M×K) · B(K×N) + C → result."""

    m: int
    n: int
    k: int
    a: str
    b: str
    c: str
    result: str

    def __str__(self) -> str:
        return f"{self.a}x{self.b}->{self.result} {self.m}x{self.n}x{self.k}"


@dataclass(frozen=True)
class MemoryHeap:
    size: int
    device_local: bool
    budget: int  # what VK_EXT_memory_budget says we may use (0 when unknown)


@dataclass(frozen=True)
class Capabilities:
    """Everything the engine needs to know about one Vulkan device."""

    index: int
    name: str
    driver: str
    driver_info: str
    api_version: str
    device_type: str
    uma: bool  # integrated/CPU device: weights live host-visible, no staging
    subgroup_size: int
    subgroup_min: int
    subgroup_max: int
    subgroup_size_control: bool
    shared_memory: int
    max_invocations: int
    max_workgroup_count: tuple[int, int, int]
    max_storage_range: int
    max_allocation: int
    timestamp_period_ns: float
    fp16: bool
    int8: bool
    storage16: bool
    storage8: bool
    int_dot: bool
    bf16: bool
    coopmat: tuple[CoopmatShape, ...]
    heaps: tuple[MemoryHeap, ...]
    host_visible_device_local: bool  # a memory type is both (ReBAR / UMA)
    extensions: frozenset[str] = field(repr=False)
    compute_units: int = 0  # SMs / CUs where the driver reports them (VK_NV_shader_sm_builtins, VK_AMD_shader_core_properties); 0 unknown

    def coopmat_shape(self, a: str, c: str) -> CoopmatShape | None:
        """The largest M·N·K coopmat shape with these input/accumulator types, if any."""
        shapes = [s for s in self.coopmat if s.a == a and s.b == a and s.c == c and s.result == c]
        return max(shapes, key=lambda s: (s.m * s.n * s.k, s.m), default=None)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["coopmat"] = [str(s) for s in self.coopmat]
        d["extensions"] = sorted(self.extensions)
        return d


def _version(v: int) -> str:
    return f"{v >> 22}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"


class _Instance:
    """A throw-away Vulkan instance used only for queries."""

    def __init__(self) -> None:
        self._app = vk.VkApplicationInfo(
            pApplicationName="vkflash", applicationVersion=1, pEngineName="vkflash",
            engineVersion=1, apiVersion=vk.VK_MAKE_VERSION(1, 3, 0))
        self._info = vk.VkInstanceCreateInfo(pApplicationInfo=self._app)
        try:
            self.handle = vk.vkCreateInstance(self._info, None)
        except Exception as e:  # no loader, no ICD
            raise DeviceError(f"no Vulkan driver found ({e}); run launcher/setup") from None

    def devices(self) -> list[Any]:
        return list(vk.vkEnumeratePhysicalDevices(self.handle))

    def close(self) -> None:
        vk.vkDestroyInstance(self.handle, None)


def _coopmat_shapes(inst: _Instance, pd: Any, exts: frozenset[str]) -> tuple[CoopmatShape, ...]:
    if "VK_KHR_cooperative_matrix" not in exts:
        return ()
    try:
        fn = vk.vkGetInstanceProcAddr(inst.handle, "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
    except Exception:  # lavapipe: "procedure not found"
        return ()
    out = []
    for p in fn(pd):
        if p.scope != vk.VK_SCOPE_SUBGROUP_KHR:
            continue
        names = [_COMPONENT.get(t, str(t)) for t in (p.AType, p.BType, p.CType, p.ResultType)]
        out.append(CoopmatShape(p.MSize, p.NSize, p.KSize, *names))
    return tuple(out)


def _compute_units(exts: frozenset[str], nv: Any, amd: Any) -> int:
    """SMs (NVIDIA) or CUs (AMD) from the property structs _probe chained, 0 where neither was."""
    if "VK_NV_shader_sm_builtins" in exts:
        return int(nv.shaderSMCount)
    if "VK_AMD_shader_core_properties" in exts:
        return int(amd.shaderEngineCount * amd.shaderArraysPerEngineCount * amd.computeUnitsPerShaderArray)
    return 0


def _probe(inst: _Instance, index: int, pd: Any) -> Capabilities:
    exts = frozenset(e.extensionName for e in vk.vkEnumerateDeviceExtensionProperties(pd, None))
    # properties chain (each struct kept alive by a local name until the call returns)
    sub = vk.VkPhysicalDeviceSubgroupProperties()
    ssc = vk.VkPhysicalDeviceSubgroupSizeControlProperties(pNext=vk.ffi.addressof(sub))
    drv = vk.VkPhysicalDeviceDriverProperties(pNext=vk.ffi.addressof(ssc))
    m3 = vk.VkPhysicalDeviceMaintenance3Properties(pNext=vk.ffi.addressof(drv))
    # compute units: only chained where the extension exists (an unknown struct in pNext is invalid)
    nv = vk.VkPhysicalDeviceShaderSMBuiltinsPropertiesNV(pNext=vk.ffi.addressof(m3))
    amd = vk.VkPhysicalDeviceShaderCorePropertiesAMD(pNext=vk.ffi.addressof(m3))
    head = nv if "VK_NV_shader_sm_builtins" in exts else amd if "VK_AMD_shader_core_properties" in exts else m3
    props2 = vk.VkPhysicalDeviceProperties2(pNext=vk.ffi.addressof(head))
    vk.vkGetPhysicalDeviceProperties2(pd, props2)
    p = props2.properties
    lim = p.limits
    # features chain
    f12 = vk.VkPhysicalDeviceVulkan12Features()
    f11 = vk.VkPhysicalDeviceVulkan11Features(pNext=vk.ffi.addressof(f12))
    f13 = vk.VkPhysicalDeviceVulkan13Features(pNext=vk.ffi.addressof(f11))
    idot = vk.VkPhysicalDeviceShaderIntegerDotProductFeatures(pNext=vk.ffi.addressof(f13))
    feats2 = vk.VkPhysicalDeviceFeatures2(pNext=vk.ffi.addressof(idot))
    vk.vkGetPhysicalDeviceFeatures2(pd, feats2)
    # memory + budget
    budget = vk.VkPhysicalDeviceMemoryBudgetPropertiesEXT()
    has_budget = "VK_EXT_memory_budget" in exts
    mem2 = vk.VkPhysicalDeviceMemoryProperties2(pNext=vk.ffi.addressof(budget) if has_budget else vk.ffi.NULL)
    vk.vkGetPhysicalDeviceMemoryProperties2(pd, mem2)
    mp = mem2.memoryProperties
    heaps = tuple(
        MemoryHeap(int(mp.memoryHeaps[i].size),
                   bool(mp.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT),
                   int(budget.heapBudget[i]) if has_budget else 0)
        for i in range(mp.memoryHeapCount))
    dl_hv = vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT | vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
    hvdl = any((mp.memoryTypes[i].propertyFlags & dl_hv) == dl_hv for i in range(mp.memoryTypeCount))
    dtype = _TYPES.get(p.deviceType, "other")
    return Capabilities(
        index=index,
        name=vk.ffi.string(p.deviceName).decode(),
        driver=vk.ffi.string(drv.driverName).decode(),
        driver_info=vk.ffi.string(drv.driverInfo).decode(),
        api_version=_version(p.apiVersion),
        device_type=dtype,
        uma=dtype in ("integrated", "cpu"),
        subgroup_size=sub.subgroupSize,
        subgroup_min=ssc.minSubgroupSize or sub.subgroupSize,
        subgroup_max=ssc.maxSubgroupSize or sub.subgroupSize,
        subgroup_size_control=bool(f13.subgroupSizeControl),
        shared_memory=lim.maxComputeSharedMemorySize,
        max_invocations=lim.maxComputeWorkGroupInvocations,
        max_workgroup_count=tuple(lim.maxComputeWorkGroupCount),
        max_storage_range=lim.maxStorageBufferRange,
        max_allocation=int(m3.maxMemoryAllocationSize),
        timestamp_period_ns=float(lim.timestampPeriod),
        fp16=bool(f12.shaderFloat16),
        int8=bool(f12.shaderInt8),
        storage16=bool(f11.storageBuffer16BitAccess),
        storage8=bool(f12.storageBuffer8BitAccess),
        int_dot=bool(idot.shaderIntegerDotProduct),
        bf16="VK_KHR_shader_bfloat16" in exts,
        coopmat=_coopmat_shapes(inst, pd, exts),
        heaps=heaps,
        host_visible_device_local=hvdl,
        extensions=exts,
        compute_units=_compute_units(exts, nv, amd),
    )


def list_devices() -> list[Capabilities]:
    """Capabilities of every Vulkan device, in the loader's order (the index users pass)."""
    inst = _Instance()
    try:
        return [_probe(inst, i, pd) for i, pd in enumerate(inst.devices())]
    finally:
        inst.close()


def probe(index: int) -> Capabilities:
    """Capabilities of device `index`; a clear DeviceError when it does not exist."""
    devs = list_devices()
    if not devs:
        raise DeviceError("no Vulkan device found; run launcher/setup (lavapipe is enough for tests)")
    if not 0 <= index < len(devs):
        names = ", ".join(f"{d.index}: {d.name}" for d in devs)
        raise DeviceError(f"VKFLASH_DEVICE={index} does not exist; devices: {names}")
    return devs[index]
