"""Stand-ins named `triton` and `torchvision` -- NOT those packages -- for SGLang's own modules only.

SGLang 0.5.23 imports `triton` (sglang/srt/utils/common.py:91, every module of sglang/kernels/**) and
`torchvision` (sglang/srt/multimodal/internvl_utils.py:5-7) at module level. Neither can work here: triton is
a CUDA compiler (about 1 GB as a wheel), and the index has only CUDA builds of torchvision, whose _C.so does
not load against the CPU torch. `install()` replaces `builtins.__import__` with a wrapper that serves these
stand-ins only to importers whose module name is `sglang` or starts with `sglang.`, and only when no real
package is installed. They are never put in sys.modules nor on sys.path, so torch and transformers keep
seeing no triton and no torchvision (`importlib.util.find_spec("triton") is None`), as on a machine without
them. Nothing eyas checks goes through them: every kernel launch raises TritonStubError.

What they must provide (found by importing sglang.srt.server_args and running
ServerArgs.resolve_once() for the kit's commands, SGLang 0.5.23):

triton: module-level `import triton`, `import triton.language as tl`,
  `from triton.language.extra import libdevice`, `from triton.runtime.jit import
  JITFunction`, ...; decorators @triton.jit / @triton.jit(...) /
  @triton.autotune(configs=[triton.Config(...)], key=[...]) / @triton.heuristics;
  tl.constexpr (annotations), tl.float8e4nv ... (module-level tables);
  triton.cdiv / next_power_of_2; triton.__version__.  Any synthesised submodule,
  any public attribute is a lazy placeholder.  A kernel launch (kernel[grid](...),
  .run, .warmup, calling a JITFunction) raises TritonStubError.
torchvision: `import torchvision.transforms as T` and
  `from torchvision.transforms.functional import InterpolationMode`
  (sglang/srt/multimodal/internvl_utils.py:5-7, imported through
  sglang.srt.configs -> nano_nemotron_vl).  T.Compose/T.Resize/... raise when called.
"""

from __future__ import annotations

import builtins
import enum
import importlib.util
import types

ROOTS = ("triton", "torchvision")
_MODULES: dict[str, types.ModuleType] = {}


class TritonStubError(RuntimeError):
    pass


class _Placeholder:
    """tl.float16, tl.constexpr, libdevice.exp, ...: usable at import, never computes."""

    def __init__(self, name):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        return _Placeholder(f"{self._name}(...)")

    def __getitem__(self, item):
        return _Placeholder(f"{self._name}[...]")

    def __or__(self, other):
        return _Placeholder(f"{self._name}|...")

    __ror__ = __or__

    def __repr__(self):
        return f"<triton stub {self._name}>"

    def __hash__(self):
        return hash(self._name)

    def __eq__(self, other):
        return isinstance(other, _Placeholder) and other._name == self._name

    def __mro_entries__(self, bases):
        return (object,)


def _refuse(what):
    raise TritonStubError(f"triton stub (eyas SGLang kit): {what}: Triton kernels cannot run in the CPU kit")


class JITFunction:
    def __init__(self, fn, **options):
        self.fn = fn
        self.options = options
        for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
            setattr(self, attr, getattr(fn, attr, None))

    def __getitem__(self, grid):
        def launcher(*args, **kwargs):
            _refuse(f"launch of {self.__qualname__}")

        return launcher

    def run(self, *args, **kwargs):
        _refuse(f"run of {self.__qualname__}")

    warmup = run

    def __call__(self, *args, **kwargs):
        _refuse(f"call of {self.__qualname__}")


class KernelInterface(JITFunction):
    pass


class Autotuner(JITFunction):
    pass


class Heuristics(JITFunction):
    pass


def jit(fn=None, **options):
    if fn is None:
        return lambda f: JITFunction(f, **options)
    return JITFunction(fn, **options)


def autotune(configs=None, key=None, **options):
    return lambda fn: Autotuner(fn, configs=configs, key=key, **options)


def heuristics(values):
    return lambda fn: Heuristics(fn, values=values)


class Config:
    def __init__(self, kwargs=None, num_warps=4, num_stages=3, num_ctas=1, **extra):
        self.kwargs = dict(kwargs or {})
        self.num_warps, self.num_stages, self.num_ctas = num_warps, num_stages, num_ctas
        self.extra = extra


def cdiv(x, y):
    return (x + y - 1) // y


def next_power_of_2(n):
    n = int(n)
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class OutOfResources(Exception):
    pass


class CompilationError(Exception):
    pass


class _TritonModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _StrictModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        if self.__name__ == "torchvision.transforms" and attr[:1].isupper():

            def _unavailable(*args, **kwargs):
                raise RuntimeError(f"torchvision stub (eyas SGLang kit): transforms.{attr} called")

            return _unavailable
        raise AttributeError(f"torchvision stub (eyas SGLang kit): {self.__name__}.{attr}")


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


_TRITON_NAMES = {
    "triton": dict(
        __version__="3.9.0+eyaskit.stub",
        IS_EYAS_KIT_STAND_IN=True,
        jit=jit,
        autotune=autotune,
        heuristics=heuristics,
        Config=Config,
        cdiv=cdiv,
        next_power_of_2=next_power_of_2,
        JITFunction=JITFunction,
        OutOfResources=OutOfResources,
        CompilationError=CompilationError,
        TritonStubError=TritonStubError,
    ),
    "triton.language": dict(constexpr=_Placeholder("triton.language.constexpr")),
    "triton.runtime": dict(
        JITFunction=JITFunction,
        Autotuner=Autotuner,
        Heuristics=Heuristics,
        Config=Config,
        OutOfResources=OutOfResources,
        KernelInterface=KernelInterface,
    ),
    "triton.runtime.jit": dict(JITFunction=JITFunction, KernelInterface=KernelInterface, jit=jit),
    "triton.runtime.autotuner": dict(
        Autotuner=Autotuner,
        Heuristics=Heuristics,
        autotune=autotune,
        heuristics=heuristics,
        Config=Config,
        OutOfResources=OutOfResources,
    ),
    "triton.compiler.errors": dict(CompilationError=CompilationError),
}
_TORCHVISION_NAMES = {
    "torchvision": dict(__version__="0.0.0+eyaskit.stub", IS_EYAS_KIT_STAND_IN=True),
    "torchvision.transforms": dict(InterpolationMode=InterpolationMode),
    "torchvision.transforms.functional": dict(InterpolationMode=InterpolationMode),
}


def _module(name: str) -> types.ModuleType:
    module = _MODULES.get(name)
    if module is not None:
        return module
    root = name.partition(".")[0]
    cls = _TritonModule if root == "triton" else _StrictModule
    table = _TRITON_NAMES if root == "triton" else _TORCHVISION_NAMES
    if root == "torchvision" and name not in table:
        raise ModuleNotFoundError(f"torchvision stub (eyas SGLang kit): no module {name!r}", name=name)
    module = cls(name, f"eyas SGLang kit stand-in for {name} (not the real package)")
    module.__path__ = []  # a package: submodules are synthesised on demand
    module.__dict__.update(table.get(name, {}))
    _MODULES[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(_module(parent), child, module)
    return module


def import_stub(name: str, fromlist=()):
    """What `__import__(name, fromlist=...)` returns, for a stubbed root."""
    module = _module(name)
    for item in fromlist or ():
        if item != "*" and f"{name}.{item}" in _TRITON_NAMES:
            _module(f"{name}.{item}")
    return module if fromlist else _module(name.partition(".")[0])


_real_import = builtins.__import__
STUBBED: tuple[str, ...] = ()


def _importer_is_sglang(globals_) -> bool:
    name = (globals_ or {}).get("__name__") or ""
    return name == "sglang" or name.startswith("sglang.")


def _kit_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0 and name.partition(".")[0] in STUBBED and _importer_is_sglang(globals):
        return import_stub(name, fromlist)
    return _real_import(name, globals, locals, fromlist, level)


def install() -> tuple[str, ...]:
    """Serve the stand-ins to sglang's modules from now on; the names stood in for (a real package wins)."""
    global STUBBED
    STUBBED = tuple(root for root in ROOTS if importlib.util.find_spec(root) is None)
    if STUBBED and builtins.__import__ is not _kit_import:
        builtins.__import__ = _kit_import
    return STUBBED
