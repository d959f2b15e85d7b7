"""Nominal peak FLOP/s of TensorFlow devices: `tf_hetbatch.core.devices` applied to `tf.config`.

The static split (`DynamicBatching(initial="flops")`) gives each replica a share in
proportion to its device's nominal peak; the synchronous strategies' `part_capacities` look
their replica devices up here. The tables and the CPU arithmetic live in the pure core
(`tf_hetbatch.core.devices`); this module only asks TensorFlow which device a replica runs on.
"""

from __future__ import annotations

from typing import Mapping

import tensorflow as tf

from tf_hetbatch.core import devices as _devices

__all__ = ["device_peak_flops", "gpu_peak_flops"]


def device_peak_flops(device: str) -> float:
    """Nominal peak FP32 FLOP/s of one local TensorFlow device, e.g. "/job:worker/.../GPU:1".

    CPU: `devices.cpu_capability()`; GPU: `tf.config.experimental.get_device_details` ->
    `gpu_peak_flops`, with TF32 as TensorFlow runs float32 matmuls now
    (`tf.config.experimental.tensor_float_32_execution_enabled()`). Logical devices that
    share one physical device share its peak equally (virtual GPUs are created in physical
    order, an equal number on each).

    Args:
        device: a device string as in `strategy.extended.worker_devices`.

    Returns:
        FLOP/s (> 0).

    Raises:
        ValueError: a GPU device while TensorFlow lists no physical GPU.
    """
    spec = tf.DeviceSpec.from_string(device)
    kind = (spec.device_type or "CPU").upper()
    index = spec.device_index or 0
    if kind != "GPU":
        shared = max(1, len(tf.config.list_logical_devices("CPU")))
        return _devices.cpu_capability().peak_flops / shared
    physical = tf.config.list_physical_devices("GPU")
    logical = max(1, len(tf.config.list_logical_devices("GPU")))
    if not physical:
        raise ValueError(f"Replica device {device!r} is a GPU but TensorFlow lists no physical "
                         "GPU. Fix: use DynamicBatching(initial='probe') or explicit sizes.")
    per = max(1, logical // len(physical))
    gpu = physical[min(index // per, len(physical) - 1)]
    return gpu_peak_flops(tf.config.experimental.get_device_details(gpu), gpu.name,
                          tf32=tf.config.experimental.tensor_float_32_execution_enabled(),
                          shared=per)


def gpu_peak_flops(details: Mapping[str, object], fallback_name: str, tf32: bool,
                   shared: int = 1) -> float:
    """Peak FLOP/s of one logical GPU, from TensorFlow's device details (no TensorFlow call).

    Args:
        details: `tf.config.experimental.get_device_details(gpu)`: "device_name" (may name a
            MIG slice) and "compute_capability".
        fallback_name: the name to use when `details` has no "device_name".
        tf32: whether TensorFlow runs float32 matmuls in TF32.
        shared: logical devices on this physical device (they share its peak). Default 1.

    Returns:
        `devices.gpu_capability(...).peak_flops / shared`.
    """
    capability = _devices.gpu_capability(str(details.get("device_name", fallback_name)),
                                         details.get("compute_capability"), tf32=bool(tf32))
    return capability.peak_flops / shared
