"""Per-replica compute time and step cycles: the accumulators; the values read are `ReplicaTimes`.

Each training step, every replica records the time from the start of its step to its local
gradients being ready, before the gradient all-reduce: the time it would take alone, which
synchronous training hides behind the slowest replica. Where the step starts:
- one host (`from_release=False`): when the replica's inputs are there. The work between
  steps (Keras's loop, the update dispatch) is the host's, shared by all its replicas, so it is
  no replica's own cost;
- several workers (`from_release=True`): when the previous step's all-reduce released the
  replica, so each worker's own per-step work outside the forward and backward pass counts too
  (Keras's step overhead, the optimizer update, the input fetch: on a throttled machine these
  are throttled as well), while the time it waited for slower workers does not. The first step
  after `reset_clock()` (each new input pipeline, each epoch) starts at its inputs instead.
Each replica also records its step cycle: the wall time from one release to the next, the
whole step as the cluster lives it. The first step after `reset_clock()` closes none, nor does
the first after a read that starts a new measurement (`start_measurement`): a measurement holds only
cycles wholly inside it, at its own split, without the host's work between two measurements
(a controller's update, a switch of the split). A cycle is carried by the step after it, so
of a measurement's L steps, L - 2 cycles count.

The first step at a new per-replica shape (its samples, its micro-batch count) is timed neither in
compute time nor in cycle (it counts its samples and step, not a timed step): that step builds what
its shape needs (cuDNN autotunes every convolution on a GPU, oneDNN creates its primitives on a
CPU, XLA and Grappler specialise), which the steps after it do not pay. So each change of split,
each candidate of the step-time search and each change of micro-batch count costs its window one
step; the first step of a run is one of them (each replica keeps its last step's shape in a host
scalar).

The records travel in the step's gradient all-reduce: each replica adds a [K, 6] float32 table that
is zero except its own row (compute seconds, samples, 1 step, its previous cycle's seconds, 1 if it
had one, 1 if the step is timed), so the sum, the same on every replica of every worker and exact
(each entry is one value plus zeros), holds every replica's row. Every replica adds the sum to its
copy of one ON_READ float64 [K, 6] variable; Python reads this process's first copy between steps
(`HeteroMirroredStrategy.read_replica_times`): every worker reads the whole cluster's measurements
without a collective of its own. The stamps and the records are side ops: no part of the step waits
for them; the table adds K * 6 floats to the all-reduce.

A step compiled by XLA (`model.compile(jit_compile=True)`: Keras traces the strategy's whole
`run` inside `tf.function(jit_compile=True)`) takes no stamps: the host clock cannot be read
inside an XLA cluster (`tf.timestamp` has no XLA kernel, and a `tf.py_function` none either),
and a replica's compute time is a span within the cluster. Such steps add no row and no
release: `read_replica_times` counts no steps for them, and the split stays where it is
(`stamps_possible`; the strategy says so once).
"""

import time

import tensorflow as tf

from tf_hetbatch.core.measurements import ReplicaTimes
from tf_hetbatch.distribute._upstream import clock

# Columns of a replica's row: compute seconds, samples, steps, cycle seconds, cycles, timed
# steps (`ReplicaTimes.rows`).
_COLUMNS = 6
# The cycle variable's mark after a new measurement starts: no cycle to carry, and the next
# release closes none (its cycle began before the measurement).
_NEXT_CLOSES_NONE = -1.0


def stamps_possible() -> bool:
    """Whether a step traced here can take stamps (`now`): not inside a function XLA compiles
    (the module docstring). Decided when the step is traced."""
    return not clock.in_xla_context()


def host_device(device: str) -> str:
    """The host CPU of a replica on `device`: the device itself when it is a CPU (or not
    named), else its task's CPU:0 (job, replica and task kept)."""
    spec = tf.DeviceSpec.from_string(device or "")
    if spec.device_type in (None, "CPU"):
        return device or ""
    return spec.replace(device_type="CPU", device_index=0).to_string()


def replica_host() -> str:
    """Traced in a replica's step: the host CPU of the device its ops run on ("" eagerly:
    no scope)."""
    if tf.executing_eagerly():
        return ""
    return host_device(tf.no_op().device)


def now_after(tensors) -> tf.Tensor:
    """In a step's graph: the host clock (`now`) once `tensors` are computed.

    One no-op per device waits for the tensors there (`tf.group`), and the stamp, on the host
    CPU of the replica's device, waits for it: one cross-device edge where the tensors are on
    a GPU (each edge to a host op is a send/recv pair of its own), not one per tensor; and the
    stamp names its device, so it places with soft placement off (`tf.timestamp` has no GPU
    kernel).
    """
    tensors = [t for t in tensors if t is not None]
    if not tensors or tf.executing_eagerly():
        return now()
    done = tf.group(*tensors)
    with tf.control_dependencies([done]), tf.device(host_device(done.device)):
        return now()


def now() -> tf.Tensor:
    """In a step's graph: the host clock, seconds since the epoch (float64 scalar).

    `tf.timestamp`, except under op determinism
    (`tf.config.experimental.enable_op_determinism()`), where TensorFlow refuses to run it (its
    value is not reproducible): the host's clock is then read through `tf.py_function` (0.16 ms
    more a stamp here, three a replica a step; it changes no value the model computes).
    Decided when the step is traced. The stamp is exempt from the program order `tf.function`
    gives stateful ops (`clock.independent`): it waits for what its caller makes it wait for
    (`now_after`), never for another replica's stamps.
    """
    if clock.op_determinism_enabled():
        stamp = tf.py_function(time.time, [], tf.float64)
        clock.independent(stamp)
        return tf.reshape(stamp, [])
    stamp = tf.timestamp()
    clock.independent(stamp)  # not chained to the other replicas' stamps (`clock`)
    return stamp


class TimingAccumulators:
    """The timing variables of one strategy: the cluster's [K, 5] totals (ON_READ, one copy
    per local replica, identical) and each replica's last release and cycle."""

    def __init__(self, strategy, num_local_replicas, from_release=False):
        self._strategy = strategy
        self._num_local = num_local_replicas
        self.from_release = from_release
        num = strategy.num_replicas_in_sync
        self._num_replicas = num
        with strategy.scope():
            self._totals = tf.Variable(
                tf.zeros([num, _COLUMNS], tf.float64),
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                name="hetbatch_replica_totals",
            )
            # When the last gradient all-reduce released each replica (0: not yet), and the
            # seconds from the release before it (0: none; _NEXT_CLOSES_NONE: none, nor will
            # the next release close one).
            self._release = self._local_scalar("hetbatch_release_time")
            self._cycle = self._local_scalar("hetbatch_step_cycle")
            # Each replica's last step's shape (`shape_kept`), 0: none yet.
            self._shape = self._local_scalar("hetbatch_step_shape")

    @staticmethod
    def _local_scalar(name):
        return tf.Variable(
            tf.zeros([], tf.float64),
            trainable=False,
            synchronization=tf.VariableSynchronization.ON_READ,
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            name=name,
        )

    def step_start(self, inputs_ready):
        """Replica context: the step's start, the previous release if there is one."""
        if not self.from_release:
            return inputs_ready
        previous = self._release.read_value()
        return tf.where(previous > 0, previous, inputs_ready)

    def shape_kept(self, samples, micro_batches=None):
        """Replica context: whether this step has its replica's previous step's shape (its
        `samples`, its micro-batch count), as a float64 1.0 or 0.0; records this step's."""
        shape = tf.cast(samples, tf.float64)
        if micro_batches is not None:  # exact in float64: samples < 2**32, counts < 2**20
            shape += tf.cast(micro_batches, tf.float64) * 2.0**32
        kept = tf.cast(tf.equal(self._shape.read_value(), shape), tf.float64)
        self._shape.assign(shape)
        return kept

    def row(self, seconds, samples, kept):
        """Replica context: this replica's [K, 6] float32 table of the step (zero except its
        row), to be summed in the step's all-reduce and passed to `record`. `kept`
        (`shape_kept`) 0: the step's compute is not timed."""
        cycle = tf.maximum(self._cycle.read_value(), 0.0)
        values = tf.cast(tf.stack([
            tf.cast(seconds, tf.float64) * kept,
            tf.cast(samples, tf.float64),
            tf.constant(1.0, tf.float64),
            cycle,
            tf.cast(cycle > 0, tf.float64),
            kept,
        ]), tf.float32)
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        slot = tf.one_hot(replica, self._num_replicas, dtype=tf.float32)
        return slot[:, None] * values[None, :]

    def record(self, summed_rows):
        """Replica context: adds the step's summed table (every replica's row)."""
        return self._totals.assign_add(tf.cast(summed_rows, tf.float64))

    def record_release(self, reduced, kept):
        """Replica context: stamps the release once the all-reduced values are there, and the
        cycle since the previous release (none where the step's shape is new: `kept` 0)."""
        released = now_after(tf.nest.flatten(reduced, expand_composites=True))
        # Nothing waits for the records (stateful ops the step runs anyway): the update
        # after the all-reduce gets no extra barrier.
        previous = self._release.read_value()
        closes = (previous > 0) & (self._cycle.read_value() != _NEXT_CLOSES_NONE) & (kept > 0)
        self._cycle.assign(tf.where(closes, released - previous, tf.zeros_like(released)))
        self._release.assign(released)
        return reduced

    def reset_clock(self):
        """Eager: the next step of each replica starts when its inputs are ready, closes no
        cycle, and is measured only if its shape is the last step's."""
        for variable in (self._release, self._cycle):
            for local in self._strategy.experimental_local_results(variable):
                local.assign(0.0)

    def read(self) -> ReplicaTimes:
        """Eagerly reads every replica's totals (this process's copy: no collective)."""
        first = self._strategy.experimental_local_results(self._totals)[0]
        return ReplicaTimes.from_rows(first.numpy())

    def start_measurement(self, read: ReplicaTimes):
        """Removes what was read, keeping anything recorded since (a step may be in flight),
        and starts a new measurement: the next two steps carry no cycle (the module docstring)."""
        rows = read.rows()
        for local in self._strategy.experimental_local_results(self._totals):
            local.assign_sub(rows)
        for local in self._strategy.experimental_local_results(self._cycle):
            local.assign(_NEXT_CLOSES_NONE)
