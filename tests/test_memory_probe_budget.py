"""The memory budget the probe solves a GPU's bound for, decided from fake device facts
(`tf_hetbatch.core.gpu_memory.gpu_budgets`: the pure decision), and the probe's warm-up."""

import logging

import keras
import numpy as np
import pytest

import tf_hetbatch as hb
from tf_hetbatch.core import gpu_memory
from tf_hetbatch.core.gpu_memory import BudgetSource, PhysicalGpu, SmiRow
from tf_hetbatch.distribute import memory_probe

MIB = 2**20
PCI = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def rows(*totals_mib, mig=()):
    """nvidia-smi rows in PCI bus order: index i, UUID GPU-<i>aaa..., the given totals."""
    return [SmiRow(i, f"GPU-{i}{'a' * 7}", f"00000000:{i + 1:02X}:00.0", "Fake GPU", total,
                   i in mig) for i, total in enumerate(totals_mib)]


def gpus(count, **fields):
    return [PhysicalGpu(f"/physical_device:GPU:{i}", device_name="Fake GPU",
                        compute_capability="8.0", **fields) for i in range(count)]


def less_reserve(total_mib, capability="8.0", env=None):
    total = total_mib * MIB
    return total - gpu_memory.tf_reserve_bytes(total, capability, env or {})


# --------------------------------------------------------------- where the budget comes from ----
def test_virtual_gpus_take_their_memory_limit_and_the_rest_total_less_reserve():
    physical = [PhysicalGpu("/physical_device:GPU:0", virtual_limits_mib=(1024, 2048),
                            compute_capability="8.0"),
                PhysicalGpu("/physical_device:GPU:1", compute_capability="8.0")]
    budgets = gpu_memory.gpu_budgets(physical, rows(16000, 24000), PCI)
    assert [b.logical_index for b in budgets] == [0, 1, 2]
    assert [b.physical for b in budgets] == ["/physical_device:GPU:0"] * 2 + [
        "/physical_device:GPU:1"]
    assert [b.memory_bytes for b in budgets] == [1024 * MIB, 2048 * MIB, less_reserve(24000)]
    assert [b.source for b in budgets] == [BudgetSource.VIRTUAL_DEVICE] * 2 + [
        BudgetSource.TOTAL_LESS_RESERVE]
    # A virtual device's limit needs no nvidia-smi; the others then have no budget.
    alone = gpu_memory.gpu_budgets(physical, None, PCI)
    assert [b.memory_bytes for b in alone] == [1024 * MIB, 2048 * MIB, None]
    assert "nvidia-smi did not answer" in alone[2].detail


def test_virtual_gpus_follow_their_device_ordinals_as_tensorflow_sorts_them():
    physical = [PhysicalGpu("/physical_device:GPU:0", virtual_limits_mib=(100, 200),
                            virtual_ordinals=(1, 0)),
                PhysicalGpu("/physical_device:GPU:1", virtual_limits_mib=(300,),
                            virtual_ordinals=(0,))]
    budgets = gpu_memory.gpu_budgets(physical, None, {})
    assert [b.memory_bytes // MIB for b in budgets] == [200, 300, 100]  # (ordinal, creation)


@pytest.mark.parametrize("growth, forced, says", [
    (True, "", "growth on"), (False, "", "growth off"), (False, "true", "growth on")])
def test_growth_on_or_off_the_budget_is_total_less_reserve_never_free_memory(
        growth, forced, says):
    # TensorFlow's limit is the same in both modes (growth only fills the pool on demand);
    # the rows carry no free memory at all, so none can leak into the budget.
    env = dict(PCI, TF_FORCE_GPU_ALLOW_GROWTH=forced)
    (budget,) = gpu_memory.gpu_budgets(gpus(1, memory_growth=growth), rows(40000), env)
    assert budget.memory_bytes == less_reserve(40000) == (40000 - 1536) * MIB
    assert budget.source is BudgetSource.TOTAL_LESS_RESERVE and says in budget.detail


@pytest.mark.parametrize("capability, total_mib, env, reserve_mib", [
    ("6.1", 16000, {}, 500), ("7.0", 16000, {}, 1050), ("8.6", 16000, {}, 1536),
    ("9.0", 80000, {}, 1800), (None, 16000, {}, 1800), ("8.0", 1500, {}, 225),
    ("8.0", 16000, {"TF_DEVICE_MIN_SYS_MEMORY_IN_MB": "300"}, 300),
    ("8.0", 16000, {"TF_DEVICE_MIN_SYS_MEMORY_IN_MB": "-3"}, 1536),  # TensorFlow ignores it
])
def test_the_reserve_is_tensorflows_by_compute_capability(capability, total_mib, env,
                                                          reserve_mib):
    assert gpu_memory.tf_reserve_bytes(total_mib * MIB, capability, env) == reserve_mib * MIB


# ---------------------------------------------------------- which nvidia-smi row is which GPU ----
def test_set_visible_devices_keeps_the_physical_gpus_rows():
    physical = [PhysicalGpu("/physical_device:GPU:0", visible=False),
                PhysicalGpu("/physical_device:GPU:1"), PhysicalGpu("/physical_device:GPU:2")]
    budgets = gpu_memory.gpu_budgets(physical, rows(8000, 16000, 24000), PCI)
    assert [(b.logical_index, b.physical) for b in budgets] == [
        (0, "/physical_device:GPU:1"), (1, "/physical_device:GPU:2")]
    assert [b.memory_bytes for b in budgets] == [less_reserve(16000, None),
                                                 less_reserve(24000, None)]


@pytest.mark.parametrize("env", [
    {"CUDA_VISIBLE_DEVICES": "GPU-2aaa,GPU-0aaaaaaa"},  # UUIDs (prefixes): any CUDA order
    {"CUDA_VISIBLE_DEVICES": "2,0", **PCI},              # indices: PCI bus order only
])
def test_cuda_visible_devices_picks_the_rows_in_its_order(env):
    budgets = gpu_memory.gpu_budgets(gpus(2), rows(8000, 16000, 24000), env)
    assert [b.memory_bytes for b in budgets] == [less_reserve(24000), less_reserve(8000)]
    assert "nvidia-smi row 2" in budgets[0].detail


@pytest.mark.parametrize("physical, smi, env, reason", [
    (gpus(2), rows(8000, 16000), {}, "CUDA_DEVICE_ORDER is not PCI_BUS_ID"),
    (gpus(2), rows(8000, 16000, 24000), {"CUDA_VISIBLE_DEVICES": "2,0"}, "counts in CUDA's"),
    (gpus(1), rows(8000, 16000), PCI, "CUDA sees 2 GPU(s)"),
    (gpus(3), rows(8000, 16000), PCI, "TensorFlow lists 3"),
    (gpus(1), rows(8000, 16000), {"CUDA_VISIBLE_DEVICES": "GPU-"}, "matches 2 nvidia-smi"),
    (gpus(1), rows(8000), {"CUDA_VISIBLE_DEVICES": "GPU-9"}, "matches 0 nvidia-smi"),
    (gpus(2), rows(8000, 16000), {"CUDA_VISIBLE_DEVICES": "0,0", **PCI}, "twice"),
    (gpus(1), rows(8000, 16000, mig=(1,)), {"CUDA_VISIBLE_DEVICES": "1", **PCI}, "MIG"),
    (gpus(1), rows(80000), {"CUDA_VISIBLE_DEVICES": "MIG-4f2a-0"}, "MIG instance"),
    ([PhysicalGpu("/physical_device:GPU:0", device_name="Other GPU")], rows(8000), {},
     "TensorFlow names it 'Other GPU'"),
])
def test_a_match_that_could_be_wrong_gives_no_budget_and_says_why(physical, smi, env, reason):
    budgets = gpu_memory.gpu_budgets(physical, smi, env)
    assert budgets and all(b.memory_bytes is None and b.source is BudgetSource.UNKNOWN
                           for b in budgets)
    assert all(reason in b.detail for b in budgets), [b.detail for b in budgets]


def test_a_count_mismatch_leaves_the_gpu_unbounded_with_one_warning_naming_the_fix(caplog):
    facts = lambda: (gpus(1), rows(8000, 16000), PCI)  # noqa: E731
    with caplog.at_level(logging.WARNING, logger=memory_probe.__name__):
        found = memory_probe._budgets(None, ["/gpu:0", "/cpu:0"], facts)
    assert [b for b, _, _ in found] == [None, None]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings  # the GPU's; a CPU without memory_bytes is expected
    assert "/gpu:0" in warnings[0] and "CUDA sees 2 GPU(s)" in warnings[0]
    assert "Fix: pass memory_bytes" in warnings[0]


def test_a_given_memory_bytes_is_used_as_is_and_gpu_facts_are_not_asked():
    def facts():
        raise AssertionError("asked for GPU facts although memory_bytes was given")

    found = memory_probe._budgets([5 * 2**30, None], ["/gpu:0", "/cpu:0"], facts)
    assert found[0][:2] == (5 * 2**30, BudgetSource.GIVEN)
    assert found[1][:2] == (None, BudgetSource.UNKNOWN)


def test_nvidia_smi_rows_parse_and_a_bad_line_gives_none():
    text = ("0, GPU-1f2e, 00000000:3B:00.0, NVIDIA A100-SXM4-40GB, 40960, Disabled\n"
            "1, GPU-77aa, 00000000:86:00.0, NVIDIA A100-SXM4-40GB, 40960, Enabled\n")
    parsed = gpu_memory.parse_smi_rows(text)
    assert [(r.index, r.uuid, r.pci_bus_id, r.total_mib, r.mig) for r in parsed] == [
        (0, "GPU-1f2e", "00000000:3B:00.0", 40960, False),
        (1, "GPU-77aa", "00000000:86:00.0", 40960, True)]
    old_driver = gpu_memory.parse_smi_rows("0, GPU-1, 0:1:0.0, Tesla P100, 16280\n", False)
    assert old_driver[0].total_mib == 16280 and not old_driver[0].mig
    assert gpu_memory.parse_smi_rows("0, GPU-1, 0:1:0.0, Tesla P100, [N/A], Disabled") is None


# ------------------------------------------------------------------------- the probe itself ----
@pytest.mark.parametrize("memory_bytes", [-1, 0, 1.5, "8GB", True, [2**30, -2]])
def test_a_bad_memory_bytes_is_refused_naming_it_and_the_fix(cpus, memory_bytes):
    with pytest.raises(ValueError, match=r"memory_bytes must be an int >= 1.*Received: "
                                         r"memory_bytes=.*Fix: e.g. memory_bytes="):
        hb.probe_micro_batch_limits(lambda: None, ([0.0],), cpus[:1] * (
            2 if isinstance(memory_bytes, list) else 1), memory_bytes=memory_bytes)


def test_each_size_is_warmed_up_by_one_step_before_the_measured_ones(cpus):
    # Real training on a logical CPU: each throwaway model (one per size) runs one warm-up
    # step, then `steps` measured ones, at that size.
    built = []

    def make_model():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
        built.append(model)
        return model

    rng = np.random.default_rng(0)
    data = (rng.random((64, 4), dtype=np.float32), rng.random((64, 3), dtype=np.float32))
    (probe,) = hb.probe_micro_batch_limits(make_model, data, cpus[:1], sizes=(4, 8), steps=2)
    assert [int(m.optimizer.iterations.numpy()) for m in built] == [1 + 2, 1 + 2]
    assert probe.trainable_bytes == (4 * 3 + 3) * 4 and probe.headroom_bytes == 0
    assert probe.memory_source == "unknown" and probe.bound is None
