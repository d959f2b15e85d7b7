"""A strategy's split of its global batch: what is set, what the data asks, what applies.

One class for the three tf_hetbatch strategies (replicas of one host, replicas of several
workers, asynchronous workers); pure Python, no TensorFlow. The strategies install what it
decides in their input pipelines (or scheduled steps).

The rules:
- Until a split is set, the split is even (the first B % K parts get one sample more).
- `set(sizes)` sets the split. If the training data's global batch B is known and the sizes
  do not sum to it, they are kept for the next training data (`pending`), which must be
  batched by their sum: the data in use is left alone.
- When new training data arrives (`data_arrived(B)`), a split set for it (before any data,
  or pending) must sum to B: an explicit split that does not is refused. A split of the data
  in use (the previous data's, e.g. a controller's) is re-made for the new B in its
  proportions, with one INFO line.
"""

import logging
from typing import Optional, Sequence, Tuple

from tf_hetbatch.core import split

logger = logging.getLogger(__name__)


class SplitState:
    """The split of a global batch into `num_parts` parts (replicas, or workers).

    Args:
        num_parts: K, the number of parts.
        part_name: what a part is, for messages ("replica" or "worker").
    """

    def __init__(self, num_parts: int, part_name: str = "replica"):
        self.num_parts = num_parts
        self.part_name = part_name
        self._sizes: Optional[Tuple[int, ...]] = None
        self._data_batch: Optional[int] = None
        self._explicit = False  # set for the next training data (before any, or pending)
        self._pending = False  # set for the next training data (its sum differs from B)

    @property
    def sizes(self) -> Optional[Tuple[int, ...]]:
        """The split set (also a pending one), else the even split of the data's global batch
        (None while neither is known)."""
        if self._sizes is not None:
            return self._sizes
        if self._data_batch is not None:
            return split.split_evenly(self._data_batch, self.num_parts)
        return None

    @property
    def explicit_sizes(self) -> Optional[Tuple[int, ...]]:
        """The split set, or None while the split is even."""
        return self._sizes

    @property
    def global_batch(self) -> Optional[int]:
        """The sum of the split set, else the training data's global batch (None if unknown)."""
        if self._sizes is not None:
            return sum(self._sizes)
        return self._data_batch

    @property
    def data_batch(self) -> Optional[int]:
        """The global batch of the training data that arrived last (None before any)."""
        return self._data_batch

    @property
    def pending(self) -> bool:
        """Whether the split set waits for training data batched by its sum."""
        return self._pending

    def set(self, sizes: Sequence[int]) -> bool:
        """Sets the split (validated: one int >= 0 per part).

        Returns:
            True if it applies to the training data in use (or none is known yet); False if
            it waits for the next training data, batched by its sum (logged at INFO).

        Raises:
            ValueError: wrong length, negative or non-integer sizes.
        """
        sizes = split.validate_sizes(sizes, self.num_parts)
        self._sizes = sizes
        self._pending = self._data_batch is not None and sum(sizes) != self._data_batch
        # A split that fits the data in use is that data's (e.g. a controller's, during fit):
        # later data may re-make it. One set before any data, or for other data, is for the
        # next training data, which must fit it.
        self._explicit = self._data_batch is None or self._pending
        if self._pending:
            logger.info(
                "batch sizes %s sum to %d, the training data in use is batched by %d: they "
                "apply to the next training data, which must be batched by %d.",
                list(sizes), sum(sizes), self._data_batch, sum(sizes))
        return not self._pending

    def data_arrived(self, global_batch: int) -> Optional[Tuple[int, ...]]:
        """New training data batched by `global_batch`: the split that applies to it.

        Returns:
            The sizes to install for this data, or None if the split in force already fits it
            (installed when it was set) or is the even split.

        Raises:
            ValueError: a split set since the previous data arrived does not sum to
                `global_batch`.
        """
        sizes, explicit, pending = self._sizes, self._explicit, self._pending
        previous = self._data_batch
        self._data_batch, self._explicit, self._pending = global_batch, False, False
        if sizes is None:
            return None
        if sum(sizes) == global_batch:
            return sizes if pending else None  # else installed when it was set
        if explicit:
            self._data_batch, self._explicit, self._pending = previous, explicit, pending
            raise ValueError(
                f"`batch_sizes` must sum to the dataset's global batch size {global_batch}. "
                f"Received: batch_sizes={list(sizes)} (sum {sum(sizes)}). Fix: batch the "
                f"data by {sum(sizes)}, or call set_batch_sizes() with sizes summing to "
                f"{global_batch}.")
        resplit = split.split_proportionally(global_batch, sizes)
        logger.info(
            "Training data batched by %d (the split was for %d): batch sizes %s re-split in "
            "proportion to %s.", global_batch, sum(sizes), list(sizes), list(resplit))
        self._sizes = resplit
        return resplit
