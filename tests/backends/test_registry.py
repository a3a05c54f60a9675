"""The backend seam: a backend registered with one :class:`Registration` is chosen, refused
and placed on its device kind by the registry; nothing outside ``backends/`` decides by a
backend's name."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from sharedarrays.backends import (
    Registration,
    choose_backend,
    device_of,
    get_backend,
    handle_check,
    kind_unusable,
    load_accelerators,
    names,
    register,
    registration,
    registrations,
    why_unusable,
)
from sharedarrays.backends import device as device_mod
from sharedarrays.backends.device import CPU, Device, kinds, parse_device, parse_name
from sharedarrays.backends.host import HostBackend, check_chunk_fd
from sharedarrays.errors import BackendUnavailable, PayloadError
from sharedarrays.process import STATE

PACKAGE = Path(__file__).resolve().parents[2] / "sharedarrays"


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations and device kinds made by a test are gone after it."""
    load_accelerators()  # (registered once per process: never into a copy that goes)
    for name in ("registrations", "objects", "kinds"):
        monkeypatch.setattr(STATE.backends, name, dict(getattr(STATE.backends, name)))


class FakeBackend(HostBackend):
    """A backend of a made-up accelerator kind ("fake"); host memory underneath."""

    name: ClassVar[str] = "fake-a"
    maps: ClassVar[bool] = True
    exporter_owned: ClassVar[bool] = False

    def __init__(self, device: Device) -> None:
        super().__init__()
        self.device = device


class FakeB(FakeBackend):
    name: ClassVar[str] = "fake-b"
    maps: ClassVar[bool] = False
    exporter_owned: ClassVar[bool] = True


def _register(reasons: dict[str, str | None]) -> None:
    for cls, preference in ((FakeBackend, 0), (FakeB, 1)):
        register(
            Registration(
                name=cls.name,
                kind="fake",
                factory=cls,
                preference=preference,
                maps=cls.maps,
                exporter_owned=cls.exporter_owned,
                why_unusable=lambda index, n=cls.name: (
                    reasons.get(n) if index < 4 else f"fake:{index} is out of range"
                ),
            )
        )


@pytest.mark.usefixtures("clean_registry")
def test_a_registered_backend_adds_its_device_kind() -> None:
    assert "fake" not in kinds()
    with pytest.raises(ValueError, match="unknown device 'fake:1'"):
        parse_device("fake:1")
    reasons: dict[str, str | None] = {}
    _register(reasons)
    assert "fake" in kinds() and kinds()[0] == "cpu"
    assert parse_device("fake:2") == Device("fake", 2) and str(Device("fake", 2)) == "fake:2"
    assert parse_device(" FAKE ") == Device("fake", 0)
    assert parse_name("fake:9") == Device("fake", 9)  # the form only: not asked whether usable
    with pytest.raises(BackendUnavailable, match="cannot use fake:7: fake:7 is out of range"):
        parse_device("fake:7")
    assert Device("fake", 0).needs_context and not CPU.needs_context
    assert not Device("fake", 0).is_cuda
    reasons["fake-a"] = reasons["fake-b"] = "no fake driver"
    assert kind_unusable("fake", 0) == "no fake driver"
    with pytest.raises(BackendUnavailable, match="no fake driver"):
        parse_device("fake:0")


@pytest.mark.usefixtures("clean_registry")
def test_auto_chooses_the_first_usable_backend_of_the_kind() -> None:
    reasons: dict[str, str | None] = {}
    _register(reasons)
    fake = Device("fake", 1)
    assert [r.name for r in registrations("fake")] == ["fake-a", "fake-b"]
    assert choose_backend(fake) == "fake-a"
    reasons["fake-a"] = "fake-a is broken"
    assert choose_backend(fake) == "fake-b"
    assert kind_unusable("fake", 1) is None and why_unusable("fake-a", 1) == "fake-a is broken"
    reasons["fake-b"] = "fake-b is broken"
    with pytest.raises(BackendUnavailable, match="no FAKE backend can use fake:1") as info:
        choose_backend(fake)
    assert "fake-a: fake-a is broken" in str(info.value)
    assert "fake-b: fake-b is broken" in str(info.value)
    assert choose_backend(CPU) == "host"  # other kinds keep theirs
    assert choose_backend(fake, "fake-b") == "fake-b"  # a name passes through


@pytest.mark.usefixtures("clean_registry")
def test_get_backend_refuses_a_device_of_another_kind() -> None:
    _register({})
    backend = get_backend(Device("fake", 3), "fake-b")
    assert isinstance(backend, FakeB) and backend.device == Device("fake", 3)
    assert get_backend(Device("fake", 3), "fake-b") is backend  # one per process and device
    assert backend.exporter_owned and not backend.maps
    with pytest.raises(BackendUnavailable, match=r"the fake-a backend needs a FAKE device"):
        get_backend(CPU, "fake-a")
    with pytest.raises(BackendUnavailable, match=r"only serves device 'cpu'.*'fake-a'"):
        get_backend(Device("fake", 0), "host")
    with pytest.raises(BackendUnavailable, match="unknown backend 'fake-c'"):
        get_backend(Device("fake", 0), "fake-c")


@pytest.mark.usefixtures("clean_registry")
def test_device_of_places_a_payload_on_its_kind() -> None:
    _register({})
    assert device_of("fake-a", 3) == Device("fake", 3)
    assert device_of("host", 0) == CPU and device_of("host", 5) == CPU
    assert device_of("cuda-ipc", 1) == Device("cuda", 1)  # does not ask whether it is usable
    with pytest.raises(PayloadError, match="unknown backend 'nope' in payload"):
        device_of("nope", 0)


@pytest.mark.usefixtures("clean_registry")
def test_a_registration_is_one_truth() -> None:
    _register({})
    register(registration("fake-a"))  # the same registration again: nothing changes
    with pytest.raises(ValueError, match="already registered"):
        register(Registration("fake-a", "fake", FakeB, 5, False, True))
    register(Registration("fake-liar", "fake", FakeBackend, 9, False, False))
    with pytest.raises(TypeError, match="does not match its registration"):
        get_backend(Device("fake", 0), "fake-liar")  # its object says otherwise
    assert names()[0] == "host" and "fake-a" in names()
    with pytest.raises(ValueError, match="cannot be a device kind"):
        device_mod.add_kind("cpu", lambda index: None)


def test_the_builtin_registrations() -> None:
    for name, kind, maps, owned in (
        ("host", "cpu", True, False),
        ("cuda-vmm", "cuda", True, False),
        ("cuda-ipc", "cuda", False, True),
        ("cuda-pool", "cuda", False, True),
    ):
        reg = registration(name)
        assert (reg.kind, reg.maps, reg.exporter_owned) == (kind, maps, owned)
    assert [r.name for r in registrations("cuda")] == ["cuda-vmm", "cuda-ipc", "cuda-pool"]
    assert handle_check("host") is check_chunk_fd
    assert handle_check("cuda-vmm") is None and handle_check(None) is None


# --------------------------------------------------------------------------------------------
# nothing outside backends/ decides by a backend's name or asks startswith("cuda")

_BUILTIN = {"host", "cuda-vmm", "cuda-ipc", "cuda-pool"}


def _vendor_decisions(tree: ast.AST) -> list[tuple[int, str]]:
    """Comparisons with a backend's name, and ``startswith`` of a CUDA prefix."""
    found: list[tuple[int, str]] = []

    def named(node: Any, vendor_only: bool = False) -> bool:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value.startswith("cuda-") or (not vendor_only and node.value in _BUILTIN)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):  # ("cpu", "host"): device aliases
            return any(named(e, vendor_only=True) for e in node.elts)
        return False

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(named(c) for c in [node.left, *node.comparators]):
            found.append((node.lineno, "compares with a backend's name"))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "startswith"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith("cuda")
        ):
            found.append((node.lineno, 'asks startswith("cuda...")'))
    return found


def test_the_checker_sees_vendor_decisions() -> None:
    code = (
        'a = b.startswith("cuda")\nc = d == "cuda-vmm"\ne = f in ("cuda-ipc", "x")\n'
        'g = h != "host"\ni = "cuda-vmm"\nj = k in ("cpu", "host")'
    )
    assert [line for line, _ in _vendor_decisions(ast.parse(code))] == [1, 2, 3, 4]


def test_nothing_outside_backends_asks_which_vendor() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "backends" in path.relative_to(PACKAGE).parts:
            continue
        for line, what in _vendor_decisions(ast.parse(path.read_text(), str(path))):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {what}")
    assert offenders == [], "ask the backend registry instead:\n" + "\n".join(offenders)


def test_the_cuda_backends_offer_the_stream_operations() -> None:
    """What ``api/semaphore.py`` asks of a backend (StreamBackend), and what only the host
    lacks; checked on the classes, since no CUDA device is needed for that."""
    from typing import _get_protocol_attrs  # type: ignore[attr-defined]

    from sharedarrays.backends import Backend, StreamBackend
    from sharedarrays.backends.cuda.device import CudaVmmBackend
    from sharedarrays.backends.cuda.ipc import CudaIpcBackend
    from sharedarrays.backends.cuda.pool import CudaPoolBackend

    members = _get_protocol_attrs(StreamBackend) - {"device"}  # set in __init__
    assert {"write_value", "wait_value", "value_reader", "import_semaphore"} <= members
    for cls in (CudaVmmBackend, CudaIpcBackend, CudaPoolBackend):
        assert not [m for m in members if not hasattr(cls, m)], cls
    assert CudaVmmBackend.peer_access and not CudaIpcBackend.peer_access
    assert CudaPoolBackend.values_refused and CudaVmmBackend.values_refused is None
    host = HostBackend()
    assert isinstance(host, Backend) and not isinstance(host, StreamBackend)
    assert not host.peer_access and host.export_fence() is None


def test_api_docs_name_backend_objects_by_paths_that_import() -> None:
    """``sa.backends`` is a function that hides the subpackage as an attribute: the API
    reference names what the subpackage holds by its modules, which ``from ... import``
    reaches."""
    import re

    import sharedarrays as sa

    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    targets = re.findall(r"\.\. auto\w+:: (sharedarrays\.backends\.[\w.]+)", text)
    assert len(targets) >= 5
    for target in targets:
        module, _, name = target.rpartition(".")
        assert module != "sharedarrays.backends", f"{target}: name the module it is in"
        namespace: dict[str, object] = {}
        exec(f"from {module} import {name}", namespace)
        assert namespace[name] is not None
    assert "host" in sa.list_backends()
    # the package's attribute is the subpackage: its modules are reachable through it
    import sharedarrays.backends.registry as registry

    assert sa.backends.registry is registry and sa.backends.list_backends is sa.list_backends


def test_installed_finds_imported_and_importable_modules_and_searches_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import types

    from sharedarrays.backends import base

    assert base.installed("numpy")  # imported
    missing = "sharedarrays_no_such_module_for_this_test"
    searches: list[str] = []
    real = base.importlib.util.find_spec

    def counting(name: str, *args: object) -> object:
        searches.append(name)
        return real(name, *args)

    monkeypatch.setattr(base.importlib.util, "find_spec", counting)
    assert not base.installed(missing) and not base.installed(missing)
    assert searches == [missing]  # the path is searched once
    monkeypatch.setitem(sys.modules, missing, types.ModuleType(missing))
    assert base.installed(missing)  # imported since (a stand-in, as the tests install)


def test_a_module_search_that_fails_is_an_error_and_is_made_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import errno

    import sharedarrays as sa
    from sharedarrays.backends import base

    name = "sharedarrays_no_such_module_searched_at_the_fd_limit"
    real = base.importlib.util.find_spec

    def emfile(module: str, *args: object) -> object:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(base.importlib.util, "find_spec", emfile)
    with pytest.raises(sa.HandleUnavailable, match="ulimit -n"):
        base.installed(name)
    monkeypatch.setattr(base.importlib.util, "find_spec", real)
    assert not base.installed(name)  # searched again: an answer now
