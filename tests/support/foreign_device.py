"""A device that is not the host's, on a machine that has only the host: the foreign-device tier.

Crucible's tests run on the CPU, where the compute device *is* the host, so a tensor left on (or
put on) the wrong side is never noticed there; on a GPU it is a crash (`torch.set_rng_state` of a
CUDA tensor) or a stall (a host read in the middle of a step). This module stands in for the
GPU, which cannot run here: a mock, and the tests that use it say so.

`foreign_device()` is a `TorchDispatchMode` under which the device `foreign` (PyTorch's
`privateuse1` backend, renamed) exists. Its tensors are `ForeignTensor`s: wrapper subclasses that
report `device == foreign:0` and keep their values in a CPU tensor, so every operation really
runs (on the CPU) and results can be compared. The mode holds the device to CUDA's rules:

  * an operation that mixes a foreign tensor with a host tensor of one or more dimensions fails
    as CUDA fails ("Expected all tensors to be on the same device"); 0-dim host tensors mix, as
    CUDA allows them;
  * what is CPU-only by contract refuses a foreign tensor by itself (`torch.set_rng_state`
    checks the tensor's device: no help is needed);
  * a random draw on the device refuses a host generator, and a host draw a device one;
  * every crossing between host and device is recorded in `ForeignDevice.syncs` as it would
    block the host on CUDA: a device value read on the host (`.item()`, `.tolist()`, `bool()`,
    a copy to the host), a copy from pageable host memory to the device (which includes every
    tensor made on the device from Python numbers: `torch.as_tensor(0.5, device=...)`), and
    operations whose output size depends on the data (`nonzero`, boolean-mask indexing).

torch.optim's AdamW treats `privateuse1` as an accelerator (its fused and foreach kernels list it),
so the trainer's accelerator code paths run here as they do on CUDA. FSDP2 runs over it as well
(a process group with gloo for both devices: a collective on foreign tensors runs on their
host copies), with three accommodations made within the block: DTensor dispatches before the
mode, FSDP's storage frees and re-allocations resize the host copy, and a device generator is
a host one. What the mode cannot model: streams and events (it runs everything in order) and
memory limits.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

NAME = "foreign"


def _register() -> str:
    """Make privateuse1 a device Python can own, once per process: the name, a runtime module
    (`torch.foreign`: one device, nothing to initialise), the hooks and a device guard. torch's
    own helper for Python-implemented backends does it (experimental; torch tests its
    privateuse1 Python backend with it). A process can rename privateuse1 once only."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    current = torch._C._get_privateuse1_backend_name()
    if current == "privateuseone":
        _setup_privateuseone_for_python_backend(rename=NAME, backend_module=_Runtime())
        return NAME
    return current


class _Event:
    """An event on a stream that has run everything already: complete when recorded."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Stream:
    """One stream: the mode runs every operation in order, so waiting is a no-op (FSDP makes
    its own with a priority: they are all this one in effect)."""

    # What `torch.Stream` carries (FSDP passes them to its stream-recording op).
    stream_id, device_index = 0, 0

    def __init__(self, *args, **kwargs) -> None:
        pass

    @property
    def device_type(self) -> int:
        return int(torch._C._autograd.DeviceType.PrivateUse1)

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _Event:
        return event or _Event()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Runtime:
    """`torch.foreign`: what torch (DCP's copies to the host, FSDP) asks a device runtime for."""

    _stream = _Stream()
    Stream = _Stream
    Event = _Event

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device) -> None:
        pass

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    # A draw on the device runs on the host copy with the host's default generator, so the
    # device's generator state is the host's (a CPU byte tensor, as CUDA's is too); torch's
    # `fork_rng` saves and restores it (the pipeline schedule's first-step shape inference).
    def get_rng_state(self, device=None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(state)

    def current_stream(self, device=None) -> _Stream:
        return self._stream

    @contextlib.contextmanager
    def stream(self, stream):
        yield

    def synchronize(self, device=None) -> None:
        pass


FOREIGN = torch.device(_register(), 0)
aten = torch.ops.aten

# Operations that move data between devices on purpose: mixing is what they are for.
_CROSSING = {aten._to_copy.default, aten.copy_.default, aten._copy_from.default,
             aten._copy_from_and_resize.default, aten.lift_fresh.default,
             aten.lift_fresh_copy.default}
# Reading a device value on the host.
_HOST_READS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
# The output's size depends on the values: the host must wait for them.
_DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten.unique_consecutive.default,
                   aten._unique2.default}


class ForeignTensor(torch.Tensor):
    """A tensor on the foreign device; its values live in `host_copy`, a CPU tensor."""

    host_copy: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
            dtype=data.dtype, layout=data.layout, device=FOREIGN,
            requires_grad=data.requires_grad)
        t.host_copy = data
        return t

    def __repr__(self, *, tensor_contents=None):
        return f"ForeignTensor({self.host_copy!r}, device='{FOREIGN}')"

    def __tensor_flatten__(self):
        return ["host_copy"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return ForeignTensor(inner["host_copy"])

    __torch_function__ = torch._C._disabled_torch_function_impl

    # Read on the host without the dispatcher (torch reads the memory itself): recorded here.
    def tolist(self):
        _record_read("tolist")
        return self.host_copy.tolist()

    def numpy(self, *, force: bool = False):
        raise TypeError("can't convert foreign:0 device type tensor to numpy. Use Tensor.cpu() "
                        "to copy the tensor to host memory first.")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Inside a `foreign_device()` block this is reached only from another subclass's own
        # dispatch (FSDP's DTensor running an op on its foreign local shards) while the mode's
        # handler has the mode off: the mode takes the op again.
        if _ACTIVE:
            with _Mode(_ACTIVE[-1]):
                return func(*args, **(kwargs or {}))
        # Outside: a foreign tensor that outlived its block.
        raise RuntimeError(f"{func}: a foreign-device tensor used outside foreign_device()")


@dataclass
class Sync:
    kind: str    # "read" (device -> host), "pageable-copy" (host -> device), "data-dependent"
    op: str


@dataclass
class ForeignDevice:
    """What the mode saw: the syncs in order (a test takes `mark()` and slices)."""

    syncs: list[Sync] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def mark(self) -> int:
        return len(self.syncs)

    def since(self, mark: int) -> list[Sync]:
        return self.syncs[mark:]

    def record(self, kind: str, func) -> None:
        with self._lock:
            self.syncs.append(Sync(kind, str(func)))


_ACTIVE: list[ForeignDevice] = []    # the records of the foreign_device() blocks entered


def _record_read(op: str) -> None:
    if _ACTIVE:
        _ACTIVE[-1].record("read", op)


def _is_foreign_device(device) -> bool:
    return device is not None and torch.device(device).type == FOREIGN.type


class _Mode(TorchDispatchMode):
    def __init__(self, seen: ForeignDevice):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # FSDP's DTensor dispatches first; the ops it runs on its foreign local tensors
            # come back here (as FakeTensorMode defers to subclasses it does not know).
            return NotImplemented
        kwargs = dict(kwargs or {})
        if func is aten.to.device:
            return self._to_device(types, *args, **kwargs)
        flat, _ = tree_flatten((args, kwargs))
        foreign_in = [t for t in flat if isinstance(t, ForeignTensor)]
        host_in = [t for t in flat if isinstance(t, torch.Tensor)
                   and not isinstance(t, ForeignTensor) and t.device.type == "cpu"]
        to_device = _is_foreign_device(kwargs.get("device"))
        if to_device:
            kwargs["device"] = torch.device("cpu")
        if foreign_in and func not in _CROSSING and host_in and (
                any(t.dim() > 0 for t in host_in) or not _takes_host_scalars(func)
                or _writes_host(func, args)):
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two "
                f"devices, {FOREIGN} and cpu! ({func}, as CUDA would refuse it)")
        if func in _HOST_READS and foreign_in:
            self.seen.record("read", func)
        if func in _DATA_DEPENDENT and foreign_in:
            self.seen.record("data-dependent", func)
        if func is aten.index.Tensor and foreign_in and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in flat[1:]):
            self.seen.record("data-dependent", func)
        out_foreign = self._output_on_device(func, args, kwargs, foreign_in, to_device)
        unwrapped = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if isinstance(func, torch._ops.OpOverload) and func._schema.is_mutable:
            return _aliased_returns(func, args, kwargs, unwrapped, out_foreign)
        if not out_foreign:
            return unwrapped
        return tree_map(lambda x: ForeignTensor(x) if isinstance(x, torch.Tensor) else x,
                        unwrapped)

    def _to_device(self, types, source, device, dtype, non_blocking=False, copy=False,
                   memory_format=None):
        """`Tensor.to(device, dtype)` reaching the mode whole (a call from inside a
        `torch._disable_dynamo` function, as DTensor's vocabulary-parallel loss makes, is not
        decomposed first): itself when nothing changes, as torch returns it, else the copy
        `_to_copy` makes, with its checks and records."""
        same = (source.device == torch.device(device) if torch.device(device).index is not None
                else source.device.type == torch.device(device).type)
        if same and source.dtype == dtype and not copy:
            return source
        return self.__torch_dispatch__(
            aten._to_copy.default, types, (source,),
            {"dtype": dtype, "device": device, "non_blocking": non_blocking,
             **({"memory_format": memory_format} if memory_format is not None else {})})

    def _output_on_device(self, func, args, kwargs, foreign_in, to_device) -> bool:
        if func is aten._to_copy.default:
            source = args[0]
            target = kwargs.get("device")
            if to_device:
                if not isinstance(source, ForeignTensor) and not source.is_pinned():
                    self.seen.record("pageable-copy", func)
                return True
            if isinstance(source, ForeignTensor) and target is not None:
                self.seen.record("read", func)   # device -> host: waits for the device
                return False
            return isinstance(source, ForeignTensor)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, ForeignTensor) and not isinstance(src, ForeignTensor) \
                    and not src.is_pinned():
                self.seen.record("pageable-copy", func)
            if not isinstance(dst, ForeignTensor) and isinstance(src, ForeignTensor):
                self.seen.record("read", func)
            return isinstance(dst, ForeignTensor)
        return bool(foreign_in) or to_device


# Made from Python data: torch builds these on the host and copies them over outside the
# dispatcher's reach, so they are taken one level up and sent through `.to(device)`.
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}


class _DataMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        _check_generator(args, kwargs)
        if func in _FROM_DATA and _is_foreign_device(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
            return func(*args, **kwargs).to(FOREIGN)
        return func(*args, **kwargs)


def _check_generator(args, kwargs) -> None:
    """A random draw takes a generator of its output's device, as CUDA's do ("Expected a 'cuda'
    device type for generator but found 'cpu'"). Checked here, where the caller's generator is
    still the object it made: the dispatcher hands the mode a new wrapper of the same host
    generator, whichever device it stands in for."""
    generator = kwargs.get("generator")
    if generator is None:
        return
    on_device = _is_foreign_device(kwargs.get("device")) or any(
        isinstance(t, ForeignTensor) for t in tree_flatten(args)[0])
    device_generator = type(generator) is _HostGenerator
    if on_device != device_generator:
        want, found = (FOREIGN.type, "cpu") if on_device else ("cpu", FOREIGN.type)
        raise RuntimeError(f"Expected a '{want}' device type for generator but found '{found}'")


def _aliased_returns(func, args, kwargs, unwrapped, out_foreign: bool):
    """What an in-place or out= op returns: the caller's own tensors, changed (the values live
    in their host copies, which the op wrote), not new wrappers."""
    schema = func._schema
    if not schema.returns:
        return None
    given = {arg.name: (args[i] if i < len(args) else kwargs.get(arg.name))
             for i, arg in enumerate(schema.arguments)}
    by_alias = {}
    for arg in schema.arguments:
        if arg.alias_info is not None and arg.alias_info.is_write:
            for name in arg.alias_info.before_set:
                by_alias[name] = given[arg.name]
    results = unwrapped if isinstance(unwrapped, (tuple, list)) else (unwrapped,)
    out = []
    for ret, value in zip(schema.returns, results):
        alias = ret.alias_info
        mine = (by_alias.get(next(iter(alias.before_set)))
                if alias is not None and alias.before_set else None)
        if mine is None and out_foreign and isinstance(value, torch.Tensor):
            mine = ForeignTensor(value)
        out.append(value if mine is None else mine)
    return tuple(out) if isinstance(unwrapped, (tuple, list)) else out[0]


def _takes_host_scalars(func) -> bool:
    """CUDA lets a 0-dim host tensor into an elementwise op (as a scalar argument); joining or
    stacking tensors, foreach and fused kernels need every tensor on the device."""
    name = func.__name__ if hasattr(func, "__name__") else str(func)
    return not (name.startswith(("cat", "stack", "_foreach", "_fused", "index_put",
                                 "_index_put")))


def _writes_host(func, args) -> bool:
    """An in-place op writing a host tensor from device values (CUDA refuses it)."""
    schema = getattr(func, "_schema", None)
    return bool(schema is not None and schema.arguments and args
                and schema.arguments[0].is_write and not isinstance(args[0], ForeignTensor)
                and isinstance(args[0], torch.Tensor))


def _unwrap(x):
    return x.host_copy if isinstance(x, ForeignTensor) else x


def _storage_of(tensor: torch.Tensor):
    return (tensor.host_copy if isinstance(tensor, ForeignTensor) else tensor).untyped_storage()


def _alloc_storage(tensor: torch.Tensor) -> None:
    size = tensor.numel() * tensor.itemsize
    if (storage := _storage_of(tensor)).size() != size:
        storage.resize_(size)


def _free_storage(tensor: torch.Tensor) -> None:
    if (storage := _storage_of(tensor)).size() != 0:
        storage.resize_(0)


@contextlib.contextmanager
def _fsdp_storage_on_the_host_copies():
    """FSDP2 frees and re-allocates its all-gather buffers by resizing their storage; a wrapper
    tensor has no storage of its own, so within the block its two helpers resize the host
    copy's (the same bytes, the same views). The one change the stand-in makes to FSDP."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    saved = [(module, name, getattr(module, name)) for module in (_fsdp_param, _fsdp_param_group)
             for name in ("alloc_storage", "free_storage") if hasattr(module, name)]
    for module, name, _ in saved:
        setattr(module, name, _alloc_storage if name == "alloc_storage" else _free_storage)
    try:
        yield
    finally:
        for module, name, real in saved:
            setattr(module, name, real)


_REAL_GENERATOR = torch.Generator


class _AnyGenerator(type(torch.Generator)):
    """While the stand-in is `torch.Generator`, every generator is still an instance of it."""

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, _REAL_GENERATOR)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, _REAL_GENERATOR)


class _HostGenerator(torch.Generator, metaclass=_AnyGenerator):
    """`torch.Generator(device=foreign)`: a Python backend cannot give PrivateUse1 a generator
    of its own (its hooks have no `getNewGenerator`), so a host generator stands in, seeded and
    drawn the same way; the mode runs the draw on the host copy. (CUDA's Philox numbers would
    differ anyway: tests compare with a host run made with the same stand-in; the device index
    is not checked, as the stand-in has one device.)"""

    def __new__(cls, device=None):
        if not _is_foreign_device(device):
            return _REAL_GENERATOR() if device is None else _REAL_GENERATOR(device)
        return _REAL_GENERATOR.__new__(cls, "cpu")

    def __init__(self, device=None) -> None:
        pass


@contextlib.contextmanager
def _device_generators():
    torch.Generator = _HostGenerator
    try:
        yield
    finally:
        torch.Generator = _REAL_GENERATOR


@contextlib.contextmanager
def foreign_device():
    """Within: `FOREIGN` is a device; yields the `ForeignDevice` record of its syncs."""
    seen = ForeignDevice()
    _ACTIVE.append(seen)
    try:
        with _fsdp_storage_on_the_host_copies(), _device_generators(), _DataMode(), _Mode(seen):
            yield seen
    finally:
        _ACTIVE.remove(seen)


def on_host(x) -> torch.Tensor:
    """A foreign tensor's values as a plain CPU tensor (for comparisons), without a record."""
    return x.host_copy if isinstance(x, ForeignTensor) else x
