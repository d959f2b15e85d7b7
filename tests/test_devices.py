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


def test_no_table_key_is_shadowed_by_an_earlier_one():
    # The first row whose key occurs as whole words wins: each key, read as a device name,
    # must find its own row ("H100 PCIE" not "H100", "RTX 5070 TI" not "RTX 5070", "H20" does
    # not take "H200").
    from tf_hetbatch.core.devices import _GPU_TABLE, _table_row
    keys = [row.key for row in _GPU_TABLE]
    assert len(keys) == len(set(keys))
    for row in _GPU_TABLE:
        for name in (row.key, f"NVIDIA {row.key.title()}", f"NVIDIA GeForce {row.key} 16GB"):
            assert _table_row(name) is row, (name, _table_row(name))


@pytest.mark.parametrize("name, cc, key", [
    ("NVIDIA B200", (10, 0), "B200"), ("NVIDIA H800", (9, 0), "H800"),
    ("NVIDIA H800 PCIe", (9, 0), "H800 PCIE"), ("NVIDIA H20", (9, 0), "H20"),
    ("NVIDIA H200", (9, 0), "H200"), ("NVIDIA GH200 480GB", (9, 0), "GH200"),
    ("NVIDIA H100 NVL", (9, 0), "H100 NVL"), ("NVIDIA L40S", (8, 9), "L40S"),
    ("NVIDIA GeForce RTX 5090", (12, 0), "RTX 5090"),
    ("NVIDIA GeForce RTX 5080", (12, 0), "RTX 5080"),
    ("NVIDIA GeForce RTX 5070 Ti", (12, 0), "RTX 5070 TI"),
    ("NVIDIA GeForce RTX 5070", (12, 0), "RTX 5070"),
])
def test_newer_gpus_come_from_their_own_row(name, cc, key):
    cap = gpu_capability(name, cc)
    assert cap.details["table"] == key and cap.details["mig"] is None


def test_newer_gpus_are_ordered_by_generation_and_tier():
    peak = {n: gpu_capability(n, cc, tf32=tf32).peak_flops for n, cc, tf32 in [
        ("NVIDIA H20", (9, 0), True), ("NVIDIA H100 80GB HBM3", (9, 0), True),
        ("NVIDIA B200", (10, 0), True), ("NVIDIA GeForce RTX 5070", (12, 0), False),
        ("NVIDIA GeForce RTX 5070 Ti", (12, 0), False), ("NVIDIA GeForce RTX 5080", (12, 0), False),
        ("NVIDIA GeForce RTX 5090", (12, 0), False), ("NVIDIA GeForce RTX 4090", (8, 9), False)]}
    assert peak["NVIDIA H20"] < peak["NVIDIA H100 80GB HBM3"] < peak["NVIDIA B200"]
    assert (peak["NVIDIA GeForce RTX 5070"] < peak["NVIDIA GeForce RTX 5070 Ti"]
            < peak["NVIDIA GeForce RTX 5080"] < peak["NVIDIA GeForce RTX 4090"]
            < peak["NVIDIA GeForce RTX 5090"])
    # The H800 is the H100's compute, the H20 a fraction of it.
    assert gpu_capability("NVIDIA H800", (9, 0)).peak_flops == \
        gpu_capability("NVIDIA H100 80GB HBM3", (9, 0)).peak_flops


@pytest.mark.parametrize("tf32", [True, False])
@pytest.mark.parametrize("whole, cc, total", [
    ("NVIDIA A100-SXM4-40GB", (8, 0), 7), ("NVIDIA H100 80GB HBM3", (9, 0), 7),
    ("NVIDIA H200", (9, 0), 7), ("NVIDIA A30", (8, 0), 4), ("NVIDIA B200", (10, 0), 7),
])
def test_a_mig_slice_gets_its_share_of_the_whole_gpu(whole, cc, total, tf32):
    full = gpu_capability(whole, cc, tf32=tf32).peak_flops
    for g in range(1, total + 1):
        cap = gpu_capability(f"{whole} MIG {g}g.{5 * g}gb", cc, tf32=tf32)
        assert cap.peak_flops == pytest.approx(full * g / total)
        assert cap.details["mig_share"] == pytest.approx(g / total)
        assert cap.details["table"] == gpu_capability(whole, cc).details["table"]
    # The slices of one partition (A100: 4g + 2g + 1g) add up to the whole GPU.
    parts = {7: ("4g.20gb", "2g.10gb", "1g.5gb"), 4: ("2g.12gb", "1g.6gb", "1g.6gb")}[total]
    assert sum(gpu_capability(f"{whole} MIG {p}", cc, tf32=tf32).peak_flops
               for p in parts) == pytest.approx(full)


@pytest.mark.parametrize("name, share", [
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", 1 / 7),          # CUDA / TensorFlow device_name
    ("A100-SXM4-40GB MIG 3g.20gb", 3 / 7),                # older drivers: no "NVIDIA"
    ("NVIDIA A100-SXM4-80GB MIG 2g.20gb", 2 / 7),
    ("A100-SXM4-40GB MIG 4c.7g.40gb", 4 / 7),             # a compute instance: c of the GI's g
    ("NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb", 1 / 7),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me", 1 / 7),      # media-extension profile
    ("NVIDIA H100 80GB HBM3 mig 7g.80gb", 1.0),           # the whole GPU as one instance
])
def test_mig_device_names_in_their_common_forms(name, share):
    whole = gpu_capability(name.split(" MIG ")[0].split(" mig ")[0], (8, 0)).peak_flops
    cap = gpu_capability(name, (8, 0))
    assert cap.details["mig_share"] == pytest.approx(share)
    assert cap.peak_flops == pytest.approx(whole * share)


def test_a_mig_slice_of_an_unknown_gpu_scales_the_fallback_by_seven_slices():
    whole = gpu_capability("Mystery GPU", (9, 0)).peak_flops
    assert gpu_capability("MIG 3g.20gb", (9, 0)).peak_flops == pytest.approx(whole * 3 / 7)
    with pytest.raises(ValueError, match="compute_capability"):
        gpu_capability("MIG 3g.20gb", None)


@pytest.mark.parametrize("name, words", [
    ("NVIDIA A30 MIG 7g.24gb", ["'MIG 7g.24gb'", "4 compute slices", "Fix"]),
    ("NVIDIA A100-SXM4-40GB MIG 5c.3g.20gb", ["5 compute slice(s)", "3-slice"]),
    ("NVIDIA A100-SXM4-40GB MIG", ["names a MIG device", "'1g.5gb'"]),
])
def test_impossible_or_incomplete_mig_names_are_refused(name, words):
    with pytest.raises(ValueError) as info:
        gpu_capability(name, (8, 0))
    for word in words:
        assert word in str(info.value)


def test_tf32_raises_the_peak_of_the_new_data_center_gpus_and_of_their_mig_slices():
    for name, cc in [("NVIDIA B200", (10, 0)), ("NVIDIA H20", (9, 0)), ("NVIDIA H800", (9, 0)),
                     ("NVIDIA L40S", (8, 9)), ("NVIDIA H200 MIG 2g.35gb", (9, 0))]:
        on, off = gpu_capability(name, cc, tf32=True), gpu_capability(name, cc, tf32=False)
        assert (on.details["tf32"], off.details["tf32"]) == (True, False)
        assert on.peak_flops > off.peak_flops
    # GeForce Blackwell: TF32 tensor cores run at the FP32 rate.
    assert gpu_capability("NVIDIA GeForce RTX 5090", (12, 0), tf32=True).peak_flops == \
        gpu_capability("NVIDIA GeForce RTX 5090", (12, 0), tf32=False).peak_flops
