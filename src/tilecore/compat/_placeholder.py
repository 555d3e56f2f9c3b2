"""`CallablePlaceholder`: a learning-rate schedule read back from a spec proto.

A proto stores a callable learning rate only as a tag (its qualified name), not
its code. Reading the proto back gives this placeholder, so the specs can be
compared, stacked and unstacked; calling it (training with it) is an error that
says to pass the real schedule.
"""

from __future__ import annotations

from typing import Any


class CallablePlaceholder:
    """Stands for the learning-rate callable tagged `tag`; it cannot be evaluated.

    Two placeholders are equal when their tags are.
    """

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        del args, kwargs
        raise RuntimeError(
            f"CallablePlaceholder {self.tag!r} cannot be evaluated: it was read from a spec "
            "proto, which keeps only the learning-rate callable's tag. It serves spec "
            "inspection and table stacking; to train, set the optimizer's learning_rate to the "
            "real schedule."
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CallablePlaceholder) and self.tag == other.tag

    def __hash__(self) -> int:
        return hash(self.tag)

    def __repr__(self) -> str:
        return f"CallablePlaceholder({self.tag!r})"
