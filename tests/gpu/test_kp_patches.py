"""The patched Kompute build (launcher/kp-patches) does what each patch promises, on lavapipe.

Dependent dispatch chains with kp.OpBarrier, the GIL released during eval, real eval_async,
features enabled = requested ∩ supported (checked against the `vulkan` cffi package), one
reused fence, bounded timestamps, shared pipelines; plus: the patch set applies to the sdist.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from vkflash.gpu.compile_shaders import cache_dir

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("build_kp", ROOT / "launcher" / "build_kp.py")
build_kp = importlib.util.module_from_spec(_spec)
sys.modules["build_kp"] = build_kp  # dataclasses look their module up there
_spec.loader.exec_module(build_kp)

# b[i] = a[i] + k + i + S   (S: specialization constant 0)
ADD_GLSL = """#version 450
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint S = 0;
layout(set = 0, binding = 0) readonly buffer A { uint a[]; };
layout(set = 0, binding = 1) writeonly buffer B { uint b[]; };
layout(push_constant) uniform P { uint n; uint k; } p;
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < p.n) b[i] = a[i] + p.k + i + S;
}
"""
# x[i] <- x[i]*a + c, `iters` times: a deliberately long dispatch with a checkable result.
LCG_GLSL = """#version 450
layout(local_size_x = 1) in;
layout(set = 0, binding = 0) buffer X { uint x[]; };
layout(push_constant) uniform P { uint iters; uint a; uint c; } p;
void main() {
    uint i = gl_GlobalInvocationID.x;
    uint v = x[i];
    for (uint k = 0; k < p.iters; k++) v = v * p.a + p.c;
    x[i] = v;
}
"""
# b[i] = a[i] + uint(f) + S with a float push constant and a uint spec constant.
MIXED_GLSL = """#version 450
layout(local_size_x = 64) in;
layout(constant_id = 0) const uint S = 0;
layout(set = 0, binding = 0) readonly buffer A { uint a[]; };
layout(set = 0, binding = 1) writeonly buffer B { uint b[]; };
layout(push_constant) uniform P { uint n; float f; } p;
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < p.n) b[i] = a[i] + uint(p.f) + S;
}
"""
LCG_A, LCG_C = 1664525, 1013904223
NONE = np.array([], np.uint32)


def lcg_power(x: np.ndarray, iters: int) -> np.ndarray:
    """x after `iters` steps of x <- a*x + c mod 2^32, by squaring the affine map."""
    mul, add = 1, 0  # accumulated map x -> mul*x + add
    a, c = LCG_A, LCG_C
    while iters:
        if iters & 1:
            mul, add = (a * mul) % 2**32, (a * add + c) % 2**32
        a, c = (a * a) % 2**32, (a * c + c) % 2**32
        iters >>= 1
    return ((x.astype(np.uint64) * mul + add) % 2**32).astype(np.uint32)


def compile_glsl(src: str, tmp: Path, name: str) -> bytes:
    """GLSL → SPIR-V with the venv's cmeel glslangValidator, into tmp; also kept in the SPIR-V cache
    (build/spv) so machines without a compiler (the lent GPU) run the carried result."""
    cached = cache_dir() / (
        f"kptest-{name}-{hashlib.sha256(src.encode()).hexdigest()[:16]}.spv")
    prefix = Path(sysconfig.get_paths()["purelib"]) / "cmeel.prefix"
    exe = prefix / "bin" / "glslangValidator"
    if not exe.exists():
        if cached.is_file():
            return cached.read_bytes()
        pytest.skip(f"no glslangValidator under {prefix} and no precompiled {cached.name}")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(prefix / "lib") + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    comp, spv = tmp / f"{name}.comp", tmp / f"{name}.spv"
    comp.write_text(src)
    subprocess.run([str(exe), "-V", str(comp), "-o", str(spv)], check=True, capture_output=True, env=env)
    cached.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(spv, cached)
    return spv.read_bytes()


@pytest.fixture(scope="module")
def kp():
    """The installed (patched) kp module."""
    import kp as module

    if "+vkflash." not in module.__version__ or "stock" in module.__version__:
        pytest.fail(f"kp {module.__version__} is not the patched build: run launcher/build_kp.py")
    return module


@pytest.fixture(scope="module")
def mgr(kp):
    return kp.Manager(0)


@pytest.fixture(scope="module")
def shaders(tmp_path_factory) -> dict[str, bytes]:
    tmp = tmp_path_factory.mktemp("kp_spv")
    return {name: compile_glsl(src, tmp, name)
            for name, src in (("add", ADD_GLSL), ("lcg", LCG_GLSL), ("mixed", MIXED_GLSL))}


def lcg_sequence(kp, mgr, spirv: bytes, x: np.ndarray, iters: int):
    """A sequence that uploads x, runs the long LCG dispatch on it and downloads it."""
    t = mgr.tensor_t(x)
    push = np.array([iters, LCG_A, LCG_C], np.uint32)
    algo = mgr.algorithm([t], spirv, (len(x), 1, 1), NONE, push)
    seq = mgr.sequence()
    seq.record(kp.OpTensorSyncDevice([t]))
    seq.record(kp.OpAlgoDispatch(algo, push))
    seq.record(kp.OpBarrier(kp.STAGE_COMPUTE, kp.STAGE_TRANSFER, kp.ACCESS_SHADER_WRITE, kp.ACCESS_TRANSFER_READ))
    seq.record(kp.OpTensorSyncLocal([t]))
    return seq, t


def long_iters(kp, mgr, spirv: bytes, rng, target_s: float) -> int:
    """LCG iteration count that makes one dispatch last about target_s on this device."""
    iters = 1 << 20
    seq, _ = lcg_sequence(kp, mgr, spirv, rng.integers(0, 2**32, 4, dtype=np.uint32), iters)
    t0 = time.perf_counter()
    seq.eval()
    dt = max(time.perf_counter() - t0, 1e-4)
    return int(min(2**31, iters * target_s / dt))


@pytest.mark.gpu
def test_dependent_chain_with_barriers(kp, mgr, shaders, rng):
    """≥200 dispatches, each reading the previous one's output, give the exact result."""
    n = int(rng.integers(1000, 5000))
    steps = int(rng.integers(200, 260))
    x = rng.integers(0, 2**32, n, dtype=np.uint32)
    ks = rng.integers(0, 2**32, steps, dtype=np.uint32)
    bufs = [mgr.tensor_t(x), mgr.tensor_t(np.zeros(n, np.uint32))]
    seq = mgr.sequence()
    seq.record(kp.OpTensorSyncDevice(bufs))
    want = x.copy()
    idx = np.arange(n, dtype=np.uint32)
    for j in range(steps):
        src, dst = bufs[j % 2], bufs[(j + 1) % 2]
        push = np.array([n, ks[j]], np.uint32)
        algo = mgr.algorithm([src, dst], shaders["add"], ((n + 63) // 64, 1, 1), NONE, push)
        if j:
            seq.record(kp.OpBarrier())
        seq.record(kp.OpAlgoDispatch(algo, push, transfer_barrier=(j == 0)))
        want = want + ks[j] + idx
    out = bufs[steps % 2]
    seq.record(kp.OpBarrier(kp.STAGE_COMPUTE, kp.STAGE_TRANSFER, kp.ACCESS_SHADER_WRITE, kp.ACCESS_TRANSFER_READ))
    seq.record(kp.OpTensorSyncLocal([out]))
    seq.eval()
    np.testing.assert_array_equal(out.data(), want)
    assert mgr.shared_pipeline_count() >= 1


@pytest.mark.gpu
def test_shared_pipelines_keep_spec_constants_apart(kp, mgr, shaders, rng):
    """Algorithms of one shader share a pipeline per spec-constant set, and each computes its own."""
    n = int(rng.integers(100, 700))
    x = rng.integers(0, 2**31, n, dtype=np.uint32)
    a = mgr.tensor_t(x)
    before = mgr.shared_pipeline_count()
    specs = [int(s) for s in rng.choice(10**6, 3, replace=False)]
    outs, algos = [], []
    seq = mgr.sequence()
    seq.record(kp.OpTensorSyncDevice([a]))
    push = np.array([n, 0], np.uint32)
    for s in specs + specs:  # every spec constant twice: 6 algorithms, 3 pipelines
        b = mgr.tensor_t(np.zeros(n, np.uint32))
        algos.append(mgr.algorithm([a, b], shaders["add"], ((n + 63) // 64, 1, 1), np.array([s], np.uint32), push))
        seq.record(kp.OpAlgoDispatch(algos[-1], push))
        outs.append(b)
    assert mgr.shared_pipeline_count() - before == len(specs)
    seq.record(kp.OpBarrier(kp.STAGE_COMPUTE, kp.STAGE_TRANSFER, kp.ACCESS_SHADER_WRITE, kp.ACCESS_TRANSFER_READ))
    seq.record(kp.OpTensorSyncLocal(outs))
    seq.eval()
    idx = np.arange(n, dtype=np.uint32)
    for s, b in zip(specs + specs, outs):
        np.testing.assert_array_equal(b.data(), x + idx + np.uint32(s))


@pytest.mark.gpu
def test_gil_released_during_eval(kp, mgr, shaders, rng):
    """A second Python thread keeps counting while the main thread waits in eval()."""
    iters = long_iters(kp, mgr, shaders["lcg"], rng, 1.0)  # ≫ 0.1 s even when the load that slowed the calibration lifts
    x = rng.integers(0, 2**32, 4, dtype=np.uint32)
    seq, t = lcg_sequence(kp, mgr, shaders["lcg"], x, iters)
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    th = threading.Thread(target=spin)
    th.start()
    time.sleep(0.05)
    c0 = count[0]
    t0 = time.perf_counter()
    seq.eval()
    dt = time.perf_counter() - t0
    c1 = count[0]
    stop.set()
    th.join()
    print(f"eval {dt * 1e3:.0f} ms, other thread counted {c1 - c0} meanwhile")
    assert dt > 0.1, "the long shader was too short to tell"
    assert c1 - c0 > 1000
    np.testing.assert_array_equal(t.data(), lcg_power(x, iters))


@pytest.mark.gpu
def test_eval_async_returns_before_completion(kp, mgr, shaders, rng):
    """eval_async() returns at once; is_done is false until the work finishes; eval_await completes it."""
    iters = long_iters(kp, mgr, shaders["lcg"], rng, 1.0)  # ≫ 0.1 s even when the load that slowed the calibration lifts
    x = rng.integers(0, 2**32, 4, dtype=np.uint32)
    seq, t = lcg_sequence(kp, mgr, shaders["lcg"], x, iters)
    t0 = time.perf_counter()
    seq.eval_async()
    submit_s = time.perf_counter() - t0
    assert not seq.is_done()
    assert seq.is_running()
    seq.eval_await(1000)  # 1 µs: times out, the submission stays armed
    assert seq.is_running() and not seq.is_done()
    seq.eval_await()
    total_s = time.perf_counter() - t0
    print(f"submit {submit_s * 1e3:.2f} ms, completion {total_s * 1e3:.0f} ms")
    assert seq.is_done() and not seq.is_running()
    assert submit_s < total_s / 5
    np.testing.assert_array_equal(t.data(), lcg_power(x, iters))


def cffi_features(index: int) -> tuple[dict[str, bool], set[str], set[str]]:
    """(member -> supported, the device's extensions, extensions the query could not cover) via `vulkan`."""
    import vulkan as vk

    app = vk.VkApplicationInfo(sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO, apiVersion=vk.VK_MAKE_VERSION(1, 3, 0))
    info = vk.VkInstanceCreateInfo(sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, pApplicationInfo=app)
    inst = vk.vkCreateInstance(info, None)
    try:
        phys = vk.vkEnumeratePhysicalDevices(inst)[index]
        api = vk.vkGetPhysicalDeviceProperties(phys).apiVersion
        exts = {e.extensionName for e in vk.vkEnumerateDeviceExtensionProperties(phys, None)}
        chain = []
        if api >= vk.VK_MAKE_VERSION(1, 2, 0):
            chain += [("VkPhysicalDeviceVulkan11Features", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES),
                      ("VkPhysicalDeviceVulkan12Features", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES)]
        if api >= vk.VK_MAKE_VERSION(1, 3, 0):
            chain.append(("VkPhysicalDeviceVulkan13Features", vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES))
        if "VK_KHR_cooperative_matrix" in exts:
            chain.append(("VkPhysicalDeviceCooperativeMatrixFeaturesKHR",
                          vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR))
        structs, nxt = [], vk.ffi.NULL
        for name, stype in reversed(chain):  # every struct stays referenced until the call returns
            s = vk.ffi.new(f"{name}*", {"sType": stype, "pNext": nxt})
            structs.append((name, s))
            nxt = s
        f2 = vk.ffi.new("VkPhysicalDeviceFeatures2*", {"sType": vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2,
                                                       "pNext": nxt})
        vk.vkGetPhysicalDeviceFeatures2(phys, f2)
        supported: dict[str, bool] = {}
        for field, _ in vk.ffi.typeof("VkPhysicalDeviceFeatures").fields:
            supported[field] = bool(getattr(f2.features, field))
        for name, s in structs:
            for field, _ in vk.ffi.typeof(name).fields:
                if field not in ("sType", "pNext"):
                    supported[field] = bool(getattr(s, field))
        uncovered = {"VK_KHR_shader_bfloat16"} & exts  # newer than the cffi package's headers
        return supported, exts, uncovered
    finally:
        vk.vkDestroyInstance(inst, None)


@pytest.mark.gpu
def test_enabled_features_are_requested_and_supported(mgr):
    """enabled_features() = requested ∩ supported (per `vulkan`), and extensions are reported honestly."""
    enabled = mgr.enabled_features()
    for needed in ("shaderFloat16", "shaderInt8", "storageBuffer16BitAccess", "storageBuffer8BitAccess",
                   "subgroupSizeControl", "computeFullSubgroups", "shaderIntegerDotProduct", "cooperativeMatrix",
                   "shaderBFloat16Type"):
        assert needed in enabled, f"the patch does not request {needed}"
    assert "robustBufferAccess" not in enabled
    supported, exts, uncovered = cffi_features(0)
    bf16 = {"shaderBFloat16Type", "shaderBFloat16DotProduct", "shaderBFloat16CooperativeMatrix"}
    for name, on in enabled.items():
        if name in bf16 and uncovered:
            continue
        assert on == supported.get(name, False), f"{name}: enabled={on}, supported={supported.get(name)}"
    assert set(mgr.enabled_extensions()) <= exts
    assert not set(mgr.missing_extensions()) & exts
    assert ("VK_KHR_cooperative_matrix" in mgr.enabled_extensions()) == ("VK_KHR_cooperative_matrix" in exts)


@pytest.mark.gpu
def test_missing_requested_extension_is_logged(kp, caplog):
    """A requested extension the device lacks is named in a warning, not dropped silently."""
    name = "VK_VKFLASH_no_such_extension"
    with caplog.at_level("WARNING", logger="kp"):
        m = kp.Manager(0, [], [name])
    assert name in m.missing_extensions()
    assert any(name in r.getMessage() for r in caplog.records)


@pytest.mark.gpu
@pytest.mark.parametrize("spin", [False, True])
def test_fence_reused_across_evals(kp, mgr, shaders, rng, spin):
    """Many evals of one sequence: every one waits for its own work (the fence is reset), fast, no leak."""
    n = int(rng.integers(64, 3000))
    x = rng.integers(0, 2**32, n, dtype=np.uint32)
    k = rng.integers(0, 2**32, dtype=np.uint32)
    a, b = mgr.tensor_t(x), mgr.tensor_t(np.zeros(n, np.uint32))
    push = np.array([n, k], np.uint32)
    grow = mgr.algorithm([a, b], shaders["add"], ((n + 63) // 64, 1, 1), NONE, push)
    back = mgr.algorithm([b, a], shaders["add"], ((n + 63) // 64, 1, 1), NONE, np.array([n, 0], np.uint32))
    seq = mgr.sequence()
    seq.set_spin_wait(spin)
    assert seq.spin_wait() == spin
    seq.record(kp.OpTensorSyncDevice([a]))
    seq.record(kp.OpAlgoDispatch(grow, push))
    seq.record(kp.OpBarrier())
    seq.record(kp.OpAlgoDispatch(back, np.array([n, 0], np.uint32), transfer_barrier=False))
    seq.record(kp.OpBarrier(kp.STAGE_COMPUTE, kp.STAGE_TRANSFER, kp.ACCESS_SHADER_WRITE, kp.ACCESS_TRANSFER_READ))
    seq.record(kp.OpTensorSyncLocal([a]))
    idx = np.arange(n, dtype=np.uint32)
    want = x.copy()
    for _ in range(20):  # a.data() is uploaded, stepped (+k+2i) and read back each eval
        seq.eval()
        want = want + k + idx + idx
        np.testing.assert_array_equal(a.data(), want)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    evals = 2000
    t0 = time.perf_counter()
    for _ in range(evals):
        seq.eval()
    us = (time.perf_counter() - t0) / evals * 1e6
    want = want + np.uint32(evals) * (k + idx + idx)
    np.testing.assert_array_equal(a.data(), want)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0
    print(f"spin={spin}: {us:.1f} us per eval, max RSS grew {grown_kib} KiB over {evals} evals")
    assert grown_kib < 8 * 1024


@pytest.mark.gpu
def test_timestamps_beyond_slots_and_reset(kp, mgr, shaders, rng):
    """More ops than timestamp slots is fine; repeated evals give fresh, ordered timestamps."""
    n = int(rng.integers(64, 500))
    a, b = mgr.tensor_t(np.zeros(n, np.uint32)), mgr.tensor_t(np.zeros(n, np.uint32))
    push = np.array([n, 1], np.uint32)
    algo = mgr.algorithm([a, b], shaders["add"], ((n + 63) // 64, 1, 1), NONE, push)
    slots = int(rng.integers(1, 4))
    seq = mgr.sequence(0, slots)
    for _ in range(slots + 5):
        seq.record(kp.OpAlgoDispatch(algo, push))
    last = 0
    for _ in range(3):
        seq.eval()
        ts = np.array(seq.get_timestamps(), np.uint64)
        assert len(ts) == slots + 1
        assert np.all(np.diff(ts.astype(np.int64)) >= 0) and ts[0] >= last
        last = ts[-1]


@pytest.mark.gpu
def test_mixed_spec_and_push_dtypes(kp, mgr, shaders, rng):
    """uint32 spec constants with float32 push constants; data_type() works."""
    n = int(rng.integers(64, 900))
    x = rng.integers(0, 2**31, n, dtype=np.uint32)
    s, f = int(rng.integers(0, 1000)), float(rng.integers(0, 1000))
    a, b = mgr.tensor_t(x), mgr.tensor_t(np.zeros(n, np.uint32))
    assert a.data_type() == kp.DataTypes.uint and mgr.tensor(np.zeros(3, np.float32)).data_type() == kp.DataTypes.float
    push = np.array([0, f], np.float32)
    push[:1].view(np.uint32)[0] = n
    algo = mgr.algorithm([a, b], shaders["mixed"], ((n + 63) // 64, 1, 1), np.array([s], np.uint32), push)
    seq = mgr.sequence()
    seq.record(kp.OpTensorSyncDevice([a]))
    seq.record(kp.OpAlgoDispatch(algo, push))
    seq.record(kp.OpBarrier(kp.STAGE_COMPUTE, kp.STAGE_TRANSFER, kp.ACCESS_SHADER_WRITE, kp.ACCESS_TRANSFER_READ))
    seq.record(kp.OpTensorSyncLocal([b]))
    seq.eval()
    np.testing.assert_array_equal(b.data(), x + np.uint32(int(f) + s))


def sdist_or_skip() -> Path:
    """The cached (or VKFLASH_KP_SDIST) kp sdist, without downloading anything."""
    path = Path(os.environ.get("VKFLASH_KP_SDIST") or ROOT / ".cache" / "kp" / build_kp.SDIST_NAME)
    if not path.is_file():
        pytest.skip(f"no kp sdist at {path} (launcher/build_kp.py downloads it)")
    return path


def test_patch_set_applies_in_order(tmp_path):
    """Every patch in launcher/kp-patches applies to the pinned sdist, in order."""
    src = build_kp.unpack(sdist_or_skip(), tmp_path)
    patches = build_kp.list_patches(stock=False)
    assert [p.name[:2] for p in patches] == [f"{i:02d}" for i in range(len(patches))]
    build_kp.apply_patches(src, patches)
    assert (src / "src" / "include" / "kompute" / "operations" / "OpBarrier.hpp").is_file()


def test_stale_patch_fails_naming_it(tmp_path):
    """A patch that no longer applies stops the build with its name."""
    src = build_kp.unpack(sdist_or_skip(), tmp_path)
    bad = tmp_path / "07-stale.patch"
    bad.write_text("# why\n--- a/src/Sequence.cpp\n+++ b/src/Sequence.cpp\n@@ -1,3 +1,3 @@\n"
                   "-no such line one\n+x\n no such line two\n no such line three\n")
    with pytest.raises(SystemExit, match="07-stale.patch"):
        build_kp.apply_patches(src, [bad])


def test_sdist_checksum_is_enforced(tmp_path, monkeypatch):
    """A different file given as the sdist is refused."""
    fake = tmp_path / "kp-0.9.0.tar.gz"
    with tarfile.open(fake, "w:gz"):
        pass
    monkeypatch.setenv("VKFLASH_KP_SDIST", str(fake))
    with pytest.raises(SystemExit, match="sha256"):
        build_kp.get_sdist(sys.executable)
