"""tf.data internals: a pipeline's batch size and structure, host functions, replays.

The static batch size of a pipeline, the split's own functions run inline as host functions,
the transformations of a pipeline read from its Python objects (`pipeline_steps`) and replayed
over another input, the split marker, and the gather of Keras's array input.
Canaries: `tests/test_upstream_tf_data.py`.
"""

import logging

import tensorflow as tf

from tf_hetbatch.distribute._upstream import autograph

logger = logging.getLogger(__name__)


# --- Static batch size of a tf.data pipeline -----------------------------------------------------
def static_batch_size(dataset):
    """The dataset's batch size without partial batches, or None when it cannot be inferred.

    Uses tf.data's own inference (`compute_batch_size`, which walks the pipeline to its last
    `batch`), the same one `tf.distribute` uses for rebatching. Its answer is a tensor: read
    at once when eager, and in a graph (a tf.function, a v1 graph) only where it folds to a
    constant (`tf.get_static_value`); else None, as for a pipeline it cannot see through.
    """
    from tensorflow.python.data.experimental.ops import distribute as data_distribute

    try:
        value = tf.get_static_value(data_distribute.compute_batch_size(dataset))
    except (tf.errors.OpError, TypeError, ValueError):  # pragma: no cover - defensive
        return None
    if value is None:
        return None
    value = int(value)
    return value if value > 0 else None


# --- The split's own tf.data functions: inline, and instantiated without Grappler (tensorflow) -
# `Dataset.map` runs its function with inter-op parallelism: its ops are scheduled on the
# inter-op threads the replicas compute with. For the split's per-batch bookkeeping (a few dozen
# scalar ops) that scheduling cost more CPU than the ops (several percent of a small model's
# step on 2 cores, BUILD_NOTES "Overhead"). The MapDataset op's `use_inter_op_parallelism=False`
# runs the function inline with a single-threaded executor; it is not exposed publicly. The
# function must not contain v1 control flow (no tf.cond, no tf.debugging.Assert guard).
# Every tf.data iterator instantiates its pipeline's functions anew, and tf.data runs a function
# "multi-device" by default, which Grappler optimizes at every instantiation: 3-15 ms CPU per
# function even for a trivial one, on every iterator (Keras makes two an epoch; at a 0.24-CPU
# cap four times that). A function with the attribute `experimental_ints_on_device` runs on
# the pipeline's device alone with no such pass (tensorflow/core/data/captured_function.cc), as
# TensorFlow's own prefetch-to-device functions do: for the split's functions (host-CPU ops on
# host variables) nothing is lost. Users' functions keep tf.data's default.
# AutoGraph calls the split's functions as they are (`autograph.as_is`).
_HOST_FUNCTION = {"experimental_ints_on_device": True}


def _function_dataset(input_dataset, wrapper, make_variant, element_spec=None):
    """A dataset over `input_dataset` made by one op that takes a tf.data function: the op is
    `make_variant(input_variant, wrapper, common_args)`, `wrapper` the function's
    StructuredFunctionWrapper; the elements are `element_spec(wrapper)` (default: its output)."""
    from tensorflow.python.data.ops import dataset_ops

    class _FunctionDataset(dataset_ops.UnaryDataset):
        def __init__(self):
            self._input_dataset = input_dataset
            self._map_func = wrapper
            self._name = None
            variant = make_variant(input_dataset._variant_tensor, wrapper, self._common_args)
            super().__init__(input_dataset, variant)

        def _functions(self):
            return [wrapper]

        @property
        def element_spec(self):
            return element_spec(wrapper) if element_spec else wrapper.output_structure

    return _FunctionDataset()


def _host_dataset(input_dataset, fn, transformation, make_variant, fallback, element_spec=None):
    """`_function_dataset` with `fn` traced as a host function (see above); `fallback()` (the
    stock transformation) where TensorFlow's private pieces are gone."""
    try:
        from tensorflow.python.data.ops import structured_function
        from tensorflow.python.ops import gen_dataset_ops
    except ImportError as error:  # pragma: no cover - upstream change
        logger.debug("host tf.data functions unavailable (%s): using %s", error, transformation)
        return fallback()
    wrapper = structured_function.StructuredFunctionWrapper(
        autograph.as_is(fn), transformation, dataset=input_dataset,
        defun_kwargs=dict(_HOST_FUNCTION))
    return _function_dataset(input_dataset, wrapper,
                             lambda *args: make_variant(gen_dataset_ops, *args), element_spec)


def map_inline(dataset, fn):
    """`dataset.map(fn)` with `fn` a host function run in the calling thread (see above)."""

    def make_variant(ops, variant, wrapper, common_args):
        return ops.map_dataset(
            variant, wrapper.function.captured_inputs, f=wrapper.function,
            use_inter_op_parallelism=False, preserve_cardinality=True, **common_args)

    return _host_dataset(dataset, fn, "Dataset.map()", make_variant, lambda: dataset.map(fn))


def without_map_and_batch_fusion(dataset):
    """`dataset` with tf.data's map-and-batch fusion off.

    A function that builds several `map(f).batch(n)` chains whose maps capture state (a
    worker hosting several replicas, each slice's per-sample maps run after the split) fails
    at iterator creation with the fusion on: "MutableGraphView::DeleteNodes(...) error: can't
    delete node(s) with retained fanouts(s) [MapDataset]" (TensorFlow 2.21; canary in
    tests/test_upstream_tf_data.py). Each slice's batch is one small batch of its own samples,
    so the fusion saves nothing there.
    """
    options = tf.data.Options()
    options.experimental_optimization.map_and_batch_fusion = False
    return dataset.with_options(options)


def flat_map_host(dataset, fn):
    """`dataset.flat_map(fn)` with `fn` a host function (see above)."""

    def make_variant(ops, variant, wrapper, common_args):
        return ops.flat_map_dataset(
            variant, wrapper.function.captured_inputs, f=wrapper.function, **common_args)

    return _host_dataset(dataset, fn, "Dataset.flat_map()", make_variant,
                         lambda: dataset.flat_map(fn),
                         element_spec=lambda wrapper: wrapper.output_structure.element_spec)


# --- The structure of a tf.data pipeline (tensorflow, no public API) ----------------------------
# To move per-sample input work after the split (`input_work`), the strategy reads
# how a pipeline was built: each Python `Dataset` of a transformation keeps its input in
# `_input_dataset`, a map its function (`_map_func`: a StructuredFunctionWrapper whose
# `.function` is the traced concrete function, `._func` the Python function, `.output_structure`
# its output spec) and its parallelism (`_num_parallel_calls`, `_deterministic`), a batch its
# `_batch_size` / `_drop_remainder`, a prefetch its `_buffer_size`, a shuffle its `_buffer_size`,
# `_seed`, `_seed2` and `_reshuffle_each_iteration`, a repeat, take or skip its `_count`
# (TF 2.21). Public tf.data has no view of a pipeline's transformations. Anything not
# recognised here is "other": the pipeline then runs unsplit, as before, so an upstream change
# costs speed, never correctness.
_TRANSFORM_KINDS = {
    "_PrefetchDataset": "prefetch",
    "_OptionsDataset": "options",
    "_BatchDataset": "batch",
    "_ParallelBatchDataset": "batch",
    "_MapDataset": "map",
    "_ParallelMapDataset": "map",
    "_ShuffleDataset": "shuffle",
    "_RepeatDataset": "repeat",
    "_TakeDataset": "take",
    "_SkipDataset": "skip",
}


class PipelineStep:
    """One transformation of a tf.data pipeline, as `pipeline_steps` reads it.

    Attributes:
        kind: "prefetch", "options", "batch", "map", "shuffle", "repeat", "take", "skip",
            "split_marker" or "other".
        dataset: the transformation's output dataset.
        input: its single input dataset, or None (a source, or several inputs).
        batch_size / drop_remainder: a batch's static size and flag (None if not constant).
        num_parallel_calls / deterministic: a map's (1 / None for a sequential map).
        buffer_size: a prefetch's or a shuffle's.
        count: a repeat's, take's or skip's.
        seeded: a shuffle's: whether it was given a seed (op-level or global).
    """

    def __init__(self, dataset):
        self.dataset = dataset
        name = type(dataset).__name__
        self.kind = _TRANSFORM_KINDS.get(name, "other")
        if isinstance(dataset, _SplitMarker):
            self.kind = "split_marker"
        self.input = getattr(dataset, "_input_dataset", None)
        if not isinstance(self.input, tf.data.Dataset):
            self.input = None
            if self.kind != "other":
                self.kind = "other"
        self.batch_size = self.drop_remainder = self.buffer_size = self.count = None
        self.num_parallel_calls, self.deterministic, self.seeded = 1, None, False
        if self.kind == "batch":
            self.batch_size = _constant_or_none(getattr(dataset, "_batch_size", None))
            self.drop_remainder = _constant_or_none(getattr(dataset, "_drop_remainder", None))
            if self.batch_size is None or self.drop_remainder is None:
                self.kind = "other"
        elif self.kind == "map":
            wrapper = getattr(dataset, "_map_func", None)
            if not all(hasattr(wrapper, a) for a in ("function", "_func", "output_structure")):
                self.kind = "other"
            self.num_parallel_calls = _constant_or_none(
                getattr(dataset, "_num_parallel_calls", 1)
            )
            self.deterministic = {"true": True, "false": False}.get(
                getattr(dataset, "_deterministic", "default"), None
            )
        elif self.kind in ("repeat", "take", "skip"):
            self.count = _constant_or_none(getattr(dataset, "_count", None))
            if self.count is None:
                self.kind = "other"
        elif self.kind in ("prefetch", "shuffle"):
            self.buffer_size = _constant_or_none(getattr(dataset, "_buffer_size", None))
            if self.buffer_size is None:
                self.kind = "other"
            if self.kind == "shuffle":
                # random_seed.get_seed gives (None, None) with no op seed and no global seed.
                self.seeded = getattr(dataset, "_seed", None) not in (None, 0) or getattr(
                    dataset, "_seed2", None
                ) not in (None, 0)

    @property
    def name(self):
        return type(self.dataset).__name__

    @property
    def map_function(self):
        """A map's Python function (the one passed to `Dataset.map`)."""
        return self.dataset._map_func._func


def _constant_or_none(value):
    if value is None:
        return None
    if isinstance(value, (bool, int)):
        return value
    try:
        constant = tf.get_static_value(value)
    except (TypeError, ValueError):  # pragma: no cover - e.g. a symbolic tensor
        return None
    return None if constant is None else constant.item()


def pipeline_steps(dataset):
    """The transformations of `dataset`, outermost first, down to the first with no single
    input (a source, a zip, a concatenation, ...), which is listed as "other"."""
    steps = []
    while dataset is not None:
        step = PipelineStep(dataset)
        steps.append(step)
        if step.kind == "other":
            break
        dataset = step.input
    return steps


def reshuffles_each_iteration(dataset) -> bool:
    """Whether a shuffle under `dataset` (following single inputs) draws a new order for each
    new iterator (`shuffle(..., reshuffle_each_iteration=True)`, tf.data's default): its k-th
    iterator's order depends on how many were made before it in the process. Private read: the
    shuffle's `_reshuffle_each_iteration`; canary in tests/test_upstream_tf_data.py."""
    while isinstance(dataset, tf.data.Dataset):
        if (_TRANSFORM_KINDS.get(type(dataset).__name__) == "shuffle"
                and bool(getattr(dataset, "_reshuffle_each_iteration", True))):
            return True
        dataset = getattr(dataset, "_input_dataset", None)
    return False


def first_map_below(dataset):
    """The name of the transformation just above the first map found under `dataset`
    (following single inputs through anything), or None if there is no map."""
    above = None
    while isinstance(dataset, tf.data.Dataset):
        if _TRANSFORM_KINDS.get(type(dataset).__name__) == "map":
            return type(above).__name__ if above is not None else None
        above, dataset = dataset, getattr(dataset, "_input_dataset", None)
    return None


def replay_map(dataset, step, num_parallel_calls=None):
    """`step`'s map (a "map" PipelineStep) applied to `dataset`, deterministically.

    Reuses the traced function itself (same graph, same captured state and seeds) when
    `dataset`'s elements have the spec it was traced for, and traces the Python function again
    otherwise (e.g. batches of another size than a static one). Parallelism is the original
    map's (or `num_parallel_calls`); order is always kept, whatever the original asked for.
    """
    from tensorflow.python.ops import gen_dataset_ops

    calls = step.num_parallel_calls if num_parallel_calls is None else num_parallel_calls
    calls = 1 if calls is None else calls
    wrapper = step.dataset._map_func
    if not _accepts(step.input.element_spec, dataset.element_spec):
        return dataset.map(wrapper._func, num_parallel_calls=None if calls == 1 else calls,
                           deterministic=True)

    def make_variant(variant, wrapper, common_args):
        if calls == 1:
            return gen_dataset_ops.map_dataset(
                variant, wrapper.function.captured_inputs, f=wrapper.function,
                use_inter_op_parallelism=True, preserve_cardinality=True, **common_args)
        return gen_dataset_ops.parallel_map_dataset_v2(
            variant, wrapper.function.captured_inputs, f=wrapper.function,
            num_parallel_calls=tf.constant(calls, tf.int64), deterministic="true",
            preserve_cardinality=True, **common_args)

    return _function_dataset(dataset, wrapper, make_variant)


def _accepts(traced_for, spec):
    """Whether a function traced for elements `traced_for` takes elements `spec` as they are
    (the same structure, each component a subtype: e.g. not [None] for a traced [32])."""
    try:
        tf.nest.assert_same_structure(traced_for, spec)
    except (TypeError, ValueError):
        return False
    return all(new.is_subtype_of(old)
               for old, new in zip(tf.nest.flatten(traced_for), tf.nest.flatten(spec)))


def replay_shuffle(step, dataset, seed=None):
    """`step`'s shuffle (a "shuffle" PipelineStep) rebuilt over `dataset`.

    With `seed` None, exactly the original (its buffer, its seed pair, its reshuffling), so
    the order is the one the user's pipeline gives; with `seed`, that seed instead (for an
    unseeded shuffle: each epoch still gets a new order, the same on every worker).
    """
    reshuffle = bool(getattr(step.dataset, "_reshuffle_each_iteration", True))
    if seed is not None:
        return dataset.shuffle(step.buffer_size, seed=seed, reshuffle_each_iteration=reshuffle)
    from tensorflow.python.data.ops import dataset_ops
    from tensorflow.python.ops import gen_dataset_ops

    original = step.dataset

    class _ReplayedShuffle(dataset_ops.UnaryUnchangedStructureDataset):
        def __init__(self, input_dataset):
            self._input_dataset = input_dataset
            self._buffer_size = original._buffer_size
            self._seed, self._seed2 = original._seed, original._seed2
            self._reshuffle_each_iteration = reshuffle
            self._name = None
            variant = gen_dataset_ops.shuffle_dataset_v3(
                input_dataset._variant_tensor, buffer_size=self._buffer_size,
                seed=self._seed, seed2=self._seed2,
                seed_generator=gen_dataset_ops.dummy_seed_generator(),
                reshuffle_each_iteration=reshuffle, **self._common_args)
            super().__init__(input_dataset, variant)

    return _ReplayedShuffle(dataset)


def _split_marker_class():
    from tensorflow.python.data.ops import dataset_ops

    class SplitMarker(dataset_ops.UnaryUnchangedStructureDataset):
        """Its input, unchanged (no op of its own): marks where a tf_hetbatch strategy splits."""

        def __init__(self, input_dataset):
            self._input_dataset = input_dataset
            super().__init__(input_dataset, input_dataset._variant_tensor)

    return SplitMarker


_SplitMarker = _split_marker_class()


def mark_split(dataset):
    """`dataset` itself, marked as the place where the global batch is split (no cost)."""
    return _SplitMarker(dataset)


# --- Keras's array input (keras: trainers/data_adapters/array_data_adapter.py) -----------------
# `fit(x, y, batch_size=B)` builds batches of sample indices, zips them with the whole arrays
# (`from_tensors(arrays).repeat()`) and gathers each batch in a parallel map (`grab_batch`).
# The gather works row by row, so a worker can gather only its own replicas' indices.
def keras_array_gather(step):
    """For the map step of Keras's array input: (index-batch dataset, arrays dataset), else None."""
    if step.kind != "map" or step.input is None:
        return None
    func = step.map_function
    if getattr(func, "__name__", "") != "grab_batch" or "array_data_adapter" not in getattr(
        func, "__module__", ""
    ):
        return None
    zipped = step.input
    inputs = getattr(zipped, "_datasets", None)
    if type(zipped).__name__ != "_ZipDataset" or not isinstance(inputs, tuple) or len(inputs) != 2:
        return None
    indices, arrays = inputs
    if type(arrays).__name__ != "_RepeatDataset" or indices.element_spec.shape.rank != 1:
        return None
    return indices, arrays
