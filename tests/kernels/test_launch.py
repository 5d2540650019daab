"""How kernels are launched: programmatic dependent launch on CUDA (switchable), never on the
CPU's interpreter, and every kernel written for it (a PDL parameter, a device-side wait first)."""

import ast
import importlib
import inspect
import pkgutil

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

import spillway.kernels
from spillway.kernels import utils
from spillway.protocol.local import envs

CUDA = torch.device("cuda", 0)


class RecordingKernel:
    """Stands in for a compiled kernel: records the launch it gets."""

    def __init__(self) -> None:
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(utils, "_supports_programmatic_launch", lambda index: True)
    yield
    utils.use_programmatic_launch(True)


def test_cuda_launches_pass_pdl_and_the_switch_turns_it_off(hopper):
    kernel = RecordingKernel()
    utils.for_device(kernel, CUDA)[(3,)](1, 2, BLOCK=4)
    utils.use_programmatic_launch(False)
    utils.for_device(kernel, CUDA)[(3,)](1, 2, BLOCK=4)
    assert kernel.launches == [((3,), (1, 2), dict(PDL=True, launch_pdl=True, BLOCK=4)),
                               ((3,), (1, 2), dict(PDL=False, launch_pdl=False, BLOCK=4))]


def test_older_gpus_and_the_cpu_never_use_it(monkeypatch):
    monkeypatch.setattr(utils, "_supports_programmatic_launch", lambda index: False)
    assert not utils.programmatic_launch(CUDA)
    assert not utils.programmatic_launch(torch.device("cpu"))


@pytest.mark.parametrize("value, expected", [(None, True), ("1", True), ("0", False), ("false", False)])
def test_spillway_pdl_environment_variable(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("SPILLWAY_PDL", raising=False)
    else:
        monkeypatch.setenv("SPILLWAY_PDL", value)
    assert envs.programmatic_launch() is expected


def _kernels():
    for module_info in pkgutil.iter_modules(spillway.kernels.__path__):
        module = importlib.import_module(f"spillway.kernels.{module_info.name}")
        for name, value in vars(module).items():
            # Interpreted functions when TRITON_INTERPRET=1 was set before Triton was imported.
            if isinstance(value, (JITFunction, InterpretedFunction)) and name.endswith("_kernel"):
                yield f"{module_info.name}.{name}", value


KERNELS = dict(_kernels())


def test_the_kernels_are_found():
    assert {"paged_attention_decode._decode_kernel", "rmsnorm._rms_norm_kernel",
            "qkv_prepare._prepare_qkv_kernel"} <= set(KERNELS)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_every_kernel_takes_pdl_last_and_waits_before_anything_else(name):
    function = ast.parse(inspect.getsource(KERNELS[name].fn).lstrip()).body[0]
    assert function.args.args[-1].arg == "PDL"
    body = [statement for statement in function.body
            if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant))]
    assert ast.unparse(body[0]) == "wait_for_inputs(PDL)"
