"""tf_hetbatch: data-parallel TensorFlow/Keras training on heterogeneous resources.

Replica k gets a mini-batch b_k proportional to its throughput, the global batch
B = sum(b_k) stays constant, and each replica's gradient is weighted by b_k / B, so
every update is exactly the one a single device would make on the whole global batch.

The public surface is listed below, one name per line. Names that need TensorFlow are
imported lazily on first access, so the pure-Python core (split arithmetic, device
capabilities, controllers, simulator) can be imported without TensorFlow.
"""

import importlib

__version__ = "0.1.0"

# Public name -> module that defines it.
_PUBLIC = {
    # Strategies (TensorFlow).
    "HeteroMirroredStrategy": "tf_hetbatch.distribute.strategy",
    "HeteroMultiWorkerMirroredStrategy": "tf_hetbatch.distribute.multi_worker",
    "HeteroParameterServerStrategy": "tf_hetbatch.distribute.parameter_server",
    "DeviceLayout": "tf_hetbatch.distribute.layout",
    "ReplicaTimes": "tf_hetbatch.core.measurements",
    "Staleness": "tf_hetbatch.core.measurements",
    "GradientNoise": "tf_hetbatch.core.gradient_noise",
    "split_here": "tf_hetbatch.distribute.input_work",
    "probe_micro_batch_limits": "tf_hetbatch.distribute.memory_probe",
    "MemoryProbe": "tf_hetbatch.distribute.memory_probe",
    # Protocols the strategies and controllers implement (no TensorFlow import).
    "SplitStrategy": "tf_hetbatch.core.protocols",
    "SynchronousSplitStrategy": "tf_hetbatch.core.protocols",
    "AsynchronousSplitStrategy": "tf_hetbatch.core.protocols",
    "Controller": "tf_hetbatch.core.protocols",
    # Balancing: any training loop, and its Keras callback.
    "Balancer": "tf_hetbatch.training.balancer",
    "DynamicBatching": "tf_hetbatch.training.callback",
    "ResumableCheckpoint": "tf_hetbatch.training.recovery",
    "RESTART_EXIT_CODE": "tf_hetbatch.training.preemption",
    # Asynchronous training.
    "AsyncTrainer": "tf_hetbatch.training.async_trainer",
    "ParameterServerLostError": "tf_hetbatch.training.async_trainer",
    # Dashboards.
    "BalanceWriter": "tf_hetbatch.dashboards.summaries",
    "plot_balance": "tf_hetbatch.dashboards.plot",
    # Pure core (numpy only).
    "split_proportionally": "tf_hetbatch.core.split",
    "split_evenly": "tf_hetbatch.core.split",
    "validate_sizes": "tf_hetbatch.core.split",
    "DeviceCapability": "tf_hetbatch.core.devices",
    "cpu_capability": "tf_hetbatch.core.devices",
    "gpu_capability": "tf_hetbatch.core.devices",
    "ProportionalController": "tf_hetbatch.core.controllers",
    "ModelBasedController": "tf_hetbatch.core.controllers",
    "ControllerState": "tf_hetbatch.core.controller_state",
    "ControllerConfig": "tf_hetbatch.core.controller_config",
    "simulate": "tf_hetbatch.core.sim",
    "ClusterModel": "tf_hetbatch.core.sim",
    "Slowdown": "tf_hetbatch.core.sim",
}

# Every public name, from the one table above.
__all__ = list(_PUBLIC)


def __getattr__(name):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'tf_hetbatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
