"""TensorBoard's SummaryWriter (`torch.utils.tensorboard` and tensorboardX): add_scalar and add_scalars.

add_scalar(tag, value, global_step) is a point under `tag` at global_step; add_scalars(main_tag, {tag: value},
global_step) a point under `main_tag/tag` each (TensorBoard's own run names). Without a global_step (TensorBoard
then puts every point at 0), the step is the count of points under that name so far. The event files are written
as before: the script's TensorBoard is untouched. The summary (the last value of each series) is written at exit.
"""

import functools
from types import ModuleType
from typing import Any

from trainjobs.capture.sink import Sink

SOURCE = "tensorboard"


def patch(module: ModuleType, sink: Sink) -> None:
    writer = module.SummaryWriter
    add_scalar, add_scalars = writer.add_scalar, writer.add_scalars

    @functools.wraps(add_scalar)
    def add_scalar_(self: Any, tag: Any, scalar_value: Any, global_step: Any = None, *args: Any, **kwargs: Any):
        if not sink.is_muted():
            sink.guard(SOURCE, sink.scalar, tag, scalar_value, global_step)
        with sink.muted():
            return add_scalar(self, tag, scalar_value, global_step, *args, **kwargs)

    @functools.wraps(add_scalars)
    def add_scalars_(self: Any, main_tag: Any, tag_scalar_dict: Any, global_step: Any = None, *args: Any,
                     **kwargs: Any):
        if not sink.is_muted():
            sink.guard(SOURCE, record_many, sink, main_tag, tag_scalar_dict, global_step)
        with sink.muted():
            return add_scalars(self, main_tag, tag_scalar_dict, global_step, *args, **kwargs)

    writer.add_scalar, writer.add_scalars = add_scalar_, add_scalars_


def record_many(sink: Sink, main_tag: Any, values: Any, step: Any) -> None:
    for tag, value in values.items():
        sink.scalar(f"{main_tag}/{tag}", value, step)
