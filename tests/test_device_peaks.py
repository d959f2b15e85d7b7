"""Tests for tf_hetbatch.distribute.device_peaks: TensorFlow's device details and TF32 switch
applied to the pure tables (this machine has no GPU: the GPU path runs on faked details)."""

import pytest
import tensorflow as tf

from tf_hetbatch.core.devices import gpu_capability
from tf_hetbatch.distribute import device_peaks


@pytest.fixture
def tf32_switch():
    """Restores TensorFlow's TF32 switch after the test."""
    before = tf.config.experimental.tensor_float_32_execution_enabled()
    yield
    tf.config.experimental.enable_tensor_float_32_execution(before)


def test_gpu_peak_flops_follows_tf32_and_shares_a_physical_gpu():
    details = {"device_name": "NVIDIA A100-SXM4-40GB", "compute_capability": (8, 0)}
    on = device_peaks.gpu_peak_flops(details, "/physical_device:GPU:0", tf32=True)
    off = device_peaks.gpu_peak_flops(details, "/physical_device:GPU:0", tf32=False)
    assert on > off
    assert device_peaks.gpu_peak_flops(details, "x", tf32=False, shared=2) == off / 2
    mig = dict(details, device_name="NVIDIA A100-SXM4-40GB MIG 3g.20gb")
    assert device_peaks.gpu_peak_flops(mig, "x", tf32=True) == pytest.approx(on * 3 / 7)
    # Without a device name the fallback name is looked up.
    assert device_peaks.gpu_peak_flops({"compute_capability": (7, 5)}, "Tesla T4",
                                       tf32=True) == gpu_capability("Tesla T4").peak_flops


def test_device_peak_flops_reads_tensorflows_tf32_switch(monkeypatch, tf32_switch):
    gpu = tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: [gpu] if kind == "GPU" else [])
    monkeypatch.setattr(tf.config, "list_logical_devices", lambda kind=None: [object()])
    monkeypatch.setattr(tf.config.experimental, "get_device_details", lambda device: {
        "device_name": "NVIDIA H100 80GB HBM3", "compute_capability": (9, 0)})
    peaks = {}
    for enabled in (True, False):
        tf.config.experimental.enable_tensor_float_32_execution(enabled)
        peaks[enabled] = device_peaks.device_peak_flops(
            "/job:worker/replica:0/task:0/device:GPU:0")
    assert peaks[True] == gpu_capability("NVIDIA H100 80GB HBM3", (9, 0), tf32=True).peak_flops
    assert peaks[False] == gpu_capability("NVIDIA H100 80GB HBM3", (9, 0), tf32=False).peak_flops
    assert peaks[True] > peaks[False]


def test_cpu_devices_do_not_depend_on_tf32(tf32_switch):
    peaks = set()
    for enabled in (True, False):
        tf.config.experimental.enable_tensor_float_32_execution(enabled)
        peaks.add(device_peaks.device_peak_flops("/job:localhost/replica:0/task:0/device:CPU:0"))
    assert len(peaks) == 1 and peaks.pop() > 0
