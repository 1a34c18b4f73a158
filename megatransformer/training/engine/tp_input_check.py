"""DeepSpeed AutoTP's first-forward check that tensor-parallel peers were given the same batch, over the batch
alone: the check pickles every forward argument on the source rank and unpickles it on its peers, where an
attention mask's device tensors (segments, prefixes, varlen metadata) would land on the source's device.
The masks follow from the batch's tensors, which the check still compares."""

from __future__ import annotations

EXCLUDED = ("masks",)  # forward keyword arguments the check does not see


def check_batch_without_masks(engine) -> None:
    """Replace the engine's check hook (``engine.first_dataloader_check``, removed by the check after its one
    run) with one that runs the same check without the ``EXCLUDED`` arguments."""
    handle = getattr(engine, "first_dataloader_check", None)
    if handle is None:
        return
    check = engine.module._forward_pre_hooks[handle.id]
    handle.remove()

    def batch_only(module, args, kwargs):
        check(module, args, {name: value for name, value in kwargs.items() if name not in EXCLUDED})

    engine.first_dataloader_check = engine.module.register_forward_pre_hook(batch_only, prepend=True, with_kwargs=True)
