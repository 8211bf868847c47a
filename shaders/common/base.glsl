// Shared preamble of every vkflash kernel.
// Conventions: constant_id 0 is the workgroup size (local_size_x); buffers are bound whole at
// set 0, binding i = the i-th buffer the op passes; offsets and sizes come as uint push
// constants (in elements of the binding's declared type); per-step values are read from a
// step-params buffer, never baked into push constants.
#extension GL_EXT_shader_explicit_arithmetic_types : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
layout(local_size_x_id = 0, local_size_y = 1, local_size_z = 1) in;
// MODEL.md §2's activations, one definition for every kernel (fused and plain paths then round
// alike): σ(x) = 1/(1+e^{−x}); silu(x) = x·σ(x); softplus(x) = ln(1+eˣ), or x when x > 20.
float sigmoid(float x) { return 1.0 / (1.0 + exp(-x)); }
float silu(float x) { return x * sigmoid(x); }
float softplus(float x) { return x > 20.0 ? x : log(1.0 + exp(x)); }
