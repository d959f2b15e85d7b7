"""Tests for tf_hetbatch.core.devices: nominal CPU/GPU peaks from injected system files."""

import dataclasses

import pytest

from tf_hetbatch.core.devices import DeviceCapability, cpu_capability, gpu_capability


def _cpuinfo(n=4, flags="fpu sse sse2", mhz="2000.000", model="Some CPU"):
    block = "processor\t: {i}\nmodel name\t: " + model + "\n"
    if mhz is not None:
        block += "cpu MHz\t\t: " + mhz + "\n"
    block += "flags\t\t: " + flags + "\n\n"
    return "".join(block.format(i=i) for i in range(n))


def _fake_fs(files):
    return lambda path: files.get(path)


NO_FILES = _fake_fs({})


@pytest.mark.parametrize("flags, per_cycle", [
    ("sse sse2 avx avx2 fma avx512f", 64),
    ("sse sse2 avx avx2 fma", 32),
    ("sse sse2 avx", 16),
    ("sse sse2", 8),
])
def test_cpu_peak_is_cores_times_ghz_times_flops_per_cycle(flags, per_cycle):
    cap = cpu_capability(_cpuinfo(4, flags), read_file=NO_FILES, self_cgroup="")
    assert cap.kind == "CPU"
    assert cap.peak_flops == pytest.approx(4 * 2.0e9 * per_cycle)
    assert cap.details["flops_per_cycle"] == per_cycle


def test_cpu_clock_falls_back_to_model_name_then_default():
    named = cpu_capability(_cpuinfo(2, mhz=None, model="Xeon @ 3.00GHz"), read_file=NO_FILES)
    assert named.details["ghz"] == pytest.approx(3.0)
    unknown = cpu_capability(_cpuinfo(2, mhz=None), read_file=NO_FILES)
    assert unknown.details["ghz"] == pytest.approx(2.0)


def test_cgroup_v2_quota_caps_the_cores():
    fs = _fake_fs({"/sys/fs/cgroup/cpu.max": "150000 100000\n"})
    cap = cpu_capability(_cpuinfo(8), read_file=fs, self_cgroup="0::/\n")
    assert cap.details["cores"] == pytest.approx(1.5)
    unlimited = cpu_capability(_cpuinfo(8), read_file=_fake_fs(
        {"/sys/fs/cgroup/cpu.max": "max 100000\n"}), self_cgroup="0::/\n")
    assert unlimited.details["cores"] == 8


def test_cgroup_v1_quota_of_the_process_own_group_caps_the_cores():
    fs = _fake_fs({
        "/cg/cpu/job/cpu.cfs_quota_us": "50000\n", "/cg/cpu/job/cpu.cfs_period_us": "100000\n",
        "/cg/cpu/cpu.cfs_quota_us": "-1\n", "/cg/cpu/cpu.cfs_period_us": "100000\n"})
    cap = cpu_capability(_cpuinfo(4), cgroup_root="/cg", read_file=fs,
                         self_cgroup="4:memory:/x\n2:cpu,cpuacct:/job\n")
    assert cap.details["cores"] == pytest.approx(0.5)


def test_a_quota_above_the_cpu_count_does_not_add_cores():
    fs = _fake_fs({"/sys/fs/cgroup/cpu.max": "800000 100000"})
    assert cpu_capability(_cpuinfo(2), read_file=fs).details["cores"] == 2


def test_explicit_cores_override_everything():
    cap = cpu_capability(_cpuinfo(8, "avx avx2 fma"), cores=0.25, read_file=NO_FILES)
    assert cap.peak_flops == pytest.approx(0.25 * 2.0e9 * 32)
    with pytest.raises(ValueError, match="cores"):
        cpu_capability(_cpuinfo(8), cores=0, read_file=NO_FILES)


def test_cpu_capability_reads_this_machine_without_error():
    cap = cpu_capability()
    assert cap.peak_flops > 0 and cap.details["cores"] > 0


@pytest.mark.parametrize("name, cc", [
    ("Tesla V100-SXM2-16GB", (7, 0)), ("Tesla T4", (7, 5)), ("Tesla P4", (6, 1)),
    ("Tesla P100-PCIE-16GB", (6, 0)), ("NVIDIA A100-SXM4-40GB", (8, 0)), ("NVIDIA A10", (8, 6)),
    ("NVIDIA A10G", (8, 6)), ("NVIDIA L4", (8, 9)), ("NVIDIA L40", (8, 9)),
    ("NVIDIA H100 80GB HBM3", (9, 0)), ("NVIDIA GeForce RTX 3090", (8, 6)),
    ("NVIDIA GeForce RTX 4090", (8, 9)),
])
def test_known_gpus_come_from_the_table(name, cc):
    cap = gpu_capability(name, cc)
    assert cap.kind == "GPU" and cap.details["table"] is not None and cap.peak_flops > 1e12


def test_generations_are_ordered_and_similar_names_do_not_collide():
    peak = {n: gpu_capability(n, cc, tf32=False).peak_flops for n, cc in [
        ("Tesla P4", (6, 1)), ("Tesla T4", (7, 5)), ("Tesla V100", (7, 0)),
        ("NVIDIA A100", (8, 0)), ("NVIDIA H100", (9, 0)), ("NVIDIA A10", (8, 6)),
        ("NVIDIA L40", (8, 9)), ("NVIDIA L4", (8, 9)), ("Tesla P40", (6, 1))]}
    assert peak["Tesla P4"] < peak["Tesla T4"] < peak["Tesla V100"] < peak["NVIDIA A100"]
    assert peak["NVIDIA A100"] < peak["NVIDIA H100"]
    assert peak["NVIDIA A10"] != peak["NVIDIA A100"]
    assert peak["NVIDIA L4"] != peak["NVIDIA L40"] and peak["Tesla P4"] != peak["Tesla P40"]


def test_tf32_raises_float32_peak_on_ampere_and_newer_only():
    for name, cc in [("NVIDIA A100-SXM4-40GB", (8, 0)), ("NVIDIA H100 PCIe", (9, 0))]:
        assert gpu_capability(name, cc, tf32=True).peak_flops > \
            gpu_capability(name, cc, tf32=False).peak_flops
    assert gpu_capability("Tesla T4", (7, 5), tf32=True).peak_flops == \
        gpu_capability("Tesla T4", (7, 5), tf32=False).peak_flops


def test_unknown_gpu_falls_back_on_compute_capability_or_explains_the_fix():
    newer = gpu_capability("Mystery GPU", (9, 0), tf32=False).peak_flops
    older = gpu_capability("Mystery GPU", (6, 1), tf32=False).peak_flops
    assert newer > older > 0
    with pytest.raises(ValueError, match="compute_capability"):
        gpu_capability("Mystery GPU", None)


def test_device_capability_validates_and_is_frozen():
    cap = DeviceCapability("x", "gpu", peak_flops=5e12)
    assert cap.kind == "GPU"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cap.peak_flops = 1.0
    for bad in [dict(kind="TPU", peak_flops=1.0), dict(kind="CPU", peak_flops=0.0),
                dict(kind="CPU", peak_flops=float("nan"))]:
        with pytest.raises(ValueError, match="Received"):
            DeviceCapability("x", **bad)
