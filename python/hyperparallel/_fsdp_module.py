"""FSDPModule: the methods a fully_shard-ed module gains (its class becomes FSDP<Cls>)."""

import torch

from ._module_state import ModuleState


def _state(module) -> ModuleState:
    return module._hyperparallel_state


def _cores(modules):
    cores = []
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(
                f"prefetch lists take fully_shard-ed modules; {type(module).__name__} is not one: "
                "apply hyperparallel.fully_shard to it first"
            )
        cores.append(_state(module).fsdp)
    return cores


class UnshardHandle:
    """A pending all-gather from ``FSDPModule.unshard(async_op=True)``."""

    def __init__(self, module, handle):
        self._module = module
        self._handle = handle

    def wait(self) -> None:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        _state(self._module).show()


class FSDPModule:
    """Mixed into a module's class by fully_shard (FSDP2's FSDPModule interface)."""

    def __new__(cls, *args, **kwargs):
        # FSDP<Cls>(...) builds a plain Cls: fully_shard makes FSDP modules, not constructors.
        orig_cls = cls.__mro__[cls.__mro__.index(FSDPModule) + 1]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _apply(self, *args, **kwargs):
        # nn.Module._apply (to(), to_empty(), float(), ...) swaps the DTensor parameters'
        # contents for moved or cast ones; the core's shards follow them.
        result = super()._apply(*args, **kwargs)
        _state(self).follow_moves()
        return result

    def unshard(self, async_op: bool = False):
        handle = _state(self).fsdp.unshard(async_op)
        if not async_op:
            _state(self).show()
            return None
        return UnshardHandle(self, handle)

    def reshard(self) -> None:
        _state(self).fsdp.reshard()
        _state(self).show()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        _state(self).fsdp.set_requires_gradient_sync(requires_gradient_sync, recurse)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        _state(self).fsdp.set_requires_all_reduce(requires_all_reduce, recurse)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}"
            )
        _state(self).fsdp.set_reshard_after_forward(reshard_after_forward, recurse)

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        _state(self).fsdp.set_reshard_after_backward(reshard_after_backward, recurse)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        _state(self).fsdp.set_is_last_backward(is_last_backward)

    def set_modules_to_forward_prefetch(self, modules) -> None:
        _state(self).fsdp.set_modules_to_forward_prefetch(_cores(modules))

    def set_modules_to_backward_prefetch(self, modules) -> None:
        _state(self).fsdp.set_modules_to_backward_prefetch(_cores(modules))

    def set_gradient_divide_factor(self, factor: float) -> None:
        _state(self).fsdp.set_gradient_divide_factor(float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        # FSDP2's switch to SUM collectives with explicit divisions (for backends without
        # ReduceOp.AVG): the core's collectives always work that way.
        if not isinstance(enable, bool):
            raise ValueError(f"enable should be a bool, got {type(enable)}")

    def set_post_optim_event(self, event: torch.Event) -> None:
        # The core orders its all-gathers after the current stream; waiting for the event
        # there is the same order (without letting the all-gather start before it).
        if torch.accelerator.is_available():
            torch.accelerator.current_stream().wait_event(event)
        else:
            event.synchronize()
