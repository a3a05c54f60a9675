"""Vulkan side of the external-semaphore tests: exportable Vulkan semaphores for CUDA to import.

The tests that prove CUDA can import and drive a Vulkan-exported semaphore create the
semaphore here (timeline or binary, exportable as an opaque POSIX file descriptor), hand
:meth:`VulkanSemaphore.export_fd` to CUDA (``cuImportExternalSemaphore`` with
``CU_EXTERNAL_SEMAPHORE_HANDLE_TYPE_OPAQUE_FD`` or ``..._TIMELINE_SEMAPHORE_FD``), and check
from the Vulkan side what CUDA did (or signal what CUDA waits for).

It uses the ``vulkan`` package (realitix's cffi binding, ABI mode: it ``dlopen``s
``libvulkan.so.1`` at import time and raises :class:`OSError` there when no loader is found).
Import this module anywhere: ``vulkan`` itself is imported lazily, and
:func:`vulkan_unavailable` tells a test why it should skip.

Getting Vulkan onto the GPU machine
-----------------------------------
That machine (NVIDIA H200, driver 580, no internet) ships the NVIDIA ICD but neither the
Vulkan loader nor the ``vulkan`` package; both travel with the working tree:

* Loader: the Debian ``.deb`` files in ``.gl/`` (ignored by ``.gitignore``;
  ``libvulkan1`` plus the glvnd/EGL/GL libraries), fetched on an internet machine with::

      o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
      mkdir -p /tmp/amd64/partial .gl
      apt-get $o update; (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 \\
          libopengl0 libgl1 libglx0 libgles2)

  and unpacked there (carry ``.gl``) before anything imports ``vulkan``::

      for f in .gl/*.deb; do dpkg -x $f /; done; ldconfig
      export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json

* Python: the wheels ``vulkan``, ``cffi`` and ``pycparser`` (CPython 3.12, manylinux x86_64)
  in ``.whl/`` (ignored), installed there (carry ``.whl``) with::

      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
      export PYTHONPATH=/tmp/site

Quirks of the ``vulkan`` package relied on here
-----------------------------------------------
* Struct constructors drop every *falsy* keyword (``0``, ``None``, ``[]``): the field stays
  zero, which is what a falsy value means anyway.
* ``pNext`` takes another struct object; the constructor stores its address and keeps it
  alive as long as the outer struct. Output chains work the same way: pass a
  ``VkPhysicalDeviceFeatures2(pNext=v12)`` to ``vkGetPhysicalDeviceFeatures2`` and read ``v12``.
* Array pointers take Python lists (``pSemaphores=[sem]``, ``pValues=[value]``); ``uint64``
  fields and arguments (timeline values, timeouts in ns) take plain Python ints.
* Failing calls raise the result's exception *class* (``VkErrorExtensionNotPresent``,
  ``VkTimeout`` for ``VK_TIMEOUT``...) with no message; :func:`_call` turns them into
  :class:`VulkanError` naming the call and the ``VkResult``.
* ``vkGetDeviceProcAddr(device, name)`` returns a Python wrapper with the same calling
  convention as the core functions (output arguments become return values), or raises
  ``ProcedureNotFoundError``.
* There is no ``VK_API_VERSION_1_2``: use ``VK_MAKE_VERSION(1, 2, 0)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import TracebackType
from typing import Any

NVIDIA_VENDOR_ID = 0x10DE
"""PCI vendor id of NVIDIA: such a physical device is preferred."""

OPAQUE_FD = 0x00000001
"""``VK_EXTERNAL_SEMAPHORE_HANDLE_TYPE_OPAQUE_FD_BIT``."""

EXPORT_EXTENSIONS = ("VK_KHR_external_semaphore", "VK_KHR_external_semaphore_fd")
"""Device extensions enabled for export (the first is core since Vulkan 1.1)."""

NVIDIA_ICD = "/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json"
"""Where the GPU machine's NVIDIA ICD manifest lies (for ``VK_DRIVER_FILES``)."""

_CLOSE_GRACE_S = 2.0
"""How long :meth:`VulkanDevice.close` waits for queue work still in flight."""

_vk_module: Any = None


class VulkanError(RuntimeError):
    """A Vulkan call failed, or the device lacks what these helpers need.

    Parameters
    ----------
    call
        The Vulkan function (or step) that failed, e.g. ``"vkCreateDevice"``.
    detail
        What went wrong, e.g. ``"VkErrorExtensionNotPresent (VkResult -7)"``.
    """

    def __init__(self, call: str, detail: str) -> None:
        super().__init__(f"{call} failed: {detail}")
        self.call = call
        self.detail = detail


def _vk() -> Any:
    """Import ``vulkan`` once and return it.

    Raises
    ------
    ImportError
        The package (or ``cffi``) is not installed.
    OSError
        The package found no Vulkan loader (``libvulkan.so.1``).
    """
    global _vk_module
    if _vk_module is None:
        import vulkan  # type: ignore[import-untyped,import-not-found,unused-ignore]

        _vk_module = vulkan
    return _vk_module


def _describe(exc: BaseException) -> str:
    """Name the ``VkResult`` behind one of the ``vulkan`` package's exceptions."""
    vk = _vk()
    codes = {cls: code for code, cls in vk.exception_codes.items()}
    code = codes.get(type(exc))
    text = type(exc).__name__
    if code is not None:
        text += f" (VkResult {code})"
    if str(exc):
        text += f": {exc}"
    return text


def _call(call: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn(*args)``, turning the package's exceptions into :class:`VulkanError`.

    Parameters
    ----------
    call
        The Vulkan function's name, for the error message.
    fn
        The ``vulkan`` package's wrapper.
    *args
        Its arguments.

    Returns
    -------
    Any
        Whatever the wrapper returns (the created handle, the output struct...).

    Raises
    ------
    VulkanError
        On any ``VkResult`` other than ``VK_SUCCESS``.
    """
    vk = _vk()
    try:
        return fn(*args)
    except (
        vk.VkError,
        vk.VkException,
        vk.ProcedureNotFoundError,
        vk.ExtensionNotSupportedError,
    ) as exc:
        raise VulkanError(call, _describe(exc)) from None


def _ns(timeout_s: float | None) -> int:
    """A timeout in seconds as Vulkan's uint64 nanoseconds (``None``: forever)."""
    if timeout_s is None:
        return 2**64 - 1
    return min(max(int(timeout_s * 1e9), 0), 2**64 - 1)


def _text(value: Any) -> str:
    """A ``char[]`` field as ``str`` (the package wraps some structs, not all)."""
    vk = _vk()
    if isinstance(value, vk.ffi.CData):
        return str(vk.ffi.string(value).decode("utf-8", "replace"))
    return str(value)


def vulkan_unavailable(export: bool = True) -> str | None:
    """Say why these helpers cannot be used here, or ``None`` when they can.

    Creates (and closes) a :class:`VulkanDevice`, so it checks the package, the loader, the
    driver, the device's Vulkan version, the ``timelineSemaphore`` feature and, with
    ``export``, ``VK_KHR_external_semaphore_fd`` and exportable ``OPAQUE_FD`` semaphores.

    Parameters
    ----------
    export
        Also require that semaphores can be exported as opaque file descriptors.

    Returns
    -------
    str or None
        A reason fit for ``pytest.skip``, or ``None``. Never raises.
    """
    try:
        _vk()
    except ImportError as exc:
        return f"the `vulkan` Python package (or cffi) is not installed: {exc}"
    except OSError as exc:
        return f"no Vulkan loader (libvulkan.so.1): {exc}"
    except Exception as exc:  # the package runs a lot of code at import
        return f"importing `vulkan` failed: {type(exc).__name__}: {exc}"
    try:
        with VulkanDevice(export=export):
            pass
    except VulkanError as exc:
        return str(exc)
    except Exception as exc:
        return f"Vulkan setup failed: {type(exc).__name__}: {exc}"
    return None


class VulkanDevice:
    """A Vulkan instance, physical device, logical device and one queue.

    Vulkan API 1.2; the physical device is the first NVIDIA one (vendor id ``0x10DE``), else
    the first listed. The logical device enables the ``timelineSemaphore`` feature and, with
    ``export``, :data:`EXPORT_EXTENSIONS`.

    Parameters
    ----------
    export
        Enable and require semaphore export as opaque file descriptors. Without it the
        semaphores are plain (not exportable) and :meth:`VulkanSemaphore.export_fd` raises;
        meant for drivers that cannot export (e.g. Mesa's lavapipe).

    Attributes
    ----------
    name : str
        The physical device's name.
    vendor_id : int
        Its PCI vendor id.
    api_version : tuple of int
        The version of Vulkan it supports, ``(major, minor, patch)``.
    device_uuid : bytes
        Its 16-byte UUID (``VkPhysicalDeviceIDProperties.deviceUUID``), the same as CUDA's
        ``cuDeviceGetUuid`` for the same GPU.
    extensions : frozenset of str
        The device extensions it offers.
    queue_family : int
        The queue family of :attr:`queue`.

    Raises
    ------
    VulkanError
        A call failed, or the device lacks Vulkan 1.2, timeline semaphores or (with
        ``export``) exportable ``OPAQUE_FD`` semaphores.
    ImportError, OSError
        The ``vulkan`` package or the loader is missing (see :func:`vulkan_unavailable`).

    Examples
    --------
    >>> with VulkanDevice() as dev:  # doctest: +SKIP
    ...     sem = dev.timeline()
    ...     fd = sem.export_fd()  # hand to cuImportExternalSemaphore
    ...     sem.signal(5)
    """

    def __init__(self, *, export: bool = True) -> None:
        self.export = export
        self._instance: Any = None
        self._device: Any = None
        self._queue: Any = None
        self._get_fd: Callable[..., Any] | None = None
        self._inflight: list[Any] = []
        self._semaphores: list[VulkanSemaphore] = []
        self.name = ""
        self.vendor_id = 0
        self.api_version = (0, 0, 0)
        self.device_uuid = b""
        self.extensions: frozenset[str] = frozenset()
        self.queue_family = 0
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    # -- setup ------------------------------------------------------------------------------

    def _open(self) -> None:
        vk = _vk()
        app = vk.VkApplicationInfo(
            pApplicationName="sharedarrays-tests",
            applicationVersion=1,
            pEngineName="none",
            engineVersion=1,
            apiVersion=vk.VK_MAKE_VERSION(1, 2, 0),
        )
        try:
            self._instance = _call(
                "vkCreateInstance",
                vk.vkCreateInstance,
                vk.VkInstanceCreateInfo(pApplicationInfo=app),
                None,
            )
        except VulkanError as exc:
            if "Incompatible" in exc.detail:
                raise VulkanError(
                    "vkCreateInstance",
                    f"{exc.detail}: no Vulkan driver (ICD) found; on the GPU machine set "
                    f"VK_DRIVER_FILES={NVIDIA_ICD}",
                ) from None
            raise

        physical = list(
            _call("vkEnumeratePhysicalDevices", vk.vkEnumeratePhysicalDevices, self._instance)
        )
        if not physical:
            raise VulkanError("vkEnumeratePhysicalDevices", "no Vulkan physical device")
        props = [vk.vkGetPhysicalDeviceProperties(pd) for pd in physical]
        index = next((i for i, p in enumerate(props) if p.vendorID == NVIDIA_VENDOR_ID), 0)
        pd, prop = physical[index], props[index]
        self.name = _text(prop.deviceName)
        self.vendor_id = int(prop.vendorID)
        version = int(prop.apiVersion)
        self.api_version = (
            vk.VK_VERSION_MAJOR(version),
            vk.VK_VERSION_MINOR(version),
            vk.VK_VERSION_PATCH(version),
        )
        if self.api_version[:2] < (1, 2):
            raise VulkanError(
                "vkGetPhysicalDeviceProperties",
                f"{self.name} supports Vulkan {'.'.join(map(str, self.api_version))}, "
                "below the 1.2 needed for timeline semaphores",
            )

        id_props = vk.VkPhysicalDeviceIDProperties()
        vk.vkGetPhysicalDeviceProperties2(pd, vk.VkPhysicalDeviceProperties2(pNext=id_props))
        self.device_uuid = bytes(vk.ffi.buffer(id_props.deviceUUID))

        self.extensions = frozenset(
            _text(e.extensionName)
            for e in _call(
                "vkEnumerateDeviceExtensionProperties",
                vk.vkEnumerateDeviceExtensionProperties,
                pd,
                None,
            )
        )
        enable: list[str] = []
        if self.export:
            missing = [e for e in EXPORT_EXTENSIONS[1:] if e not in self.extensions]
            if missing:
                raise VulkanError(
                    "vkEnumerateDeviceExtensionProperties",
                    f"{self.name} lacks the device extension {', '.join(missing)}",
                )
            enable = [e for e in EXPORT_EXTENSIONS if e in self.extensions]

        v12 = vk.VkPhysicalDeviceVulkan12Features()
        vk.vkGetPhysicalDeviceFeatures2(pd, vk.VkPhysicalDeviceFeatures2(pNext=v12))
        if not v12.timelineSemaphore:
            raise VulkanError(
                "vkGetPhysicalDeviceFeatures2",
                f"{self.name} lacks the Vulkan 1.2 feature timelineSemaphore",
            )

        if self.export:
            for kind, semaphore_type in (
                ("timeline", vk.VK_SEMAPHORE_TYPE_TIMELINE),
                ("binary", vk.VK_SEMAPHORE_TYPE_BINARY),
            ):
                info = vk.VkPhysicalDeviceExternalSemaphoreInfo(
                    pNext=vk.VkSemaphoreTypeCreateInfo(semaphoreType=semaphore_type),
                    handleType=OPAQUE_FD,
                )
                ext = vk.vkGetPhysicalDeviceExternalSemaphoreProperties(pd, info)
                exportable = vk.VK_EXTERNAL_SEMAPHORE_FEATURE_EXPORTABLE_BIT
                if not ext.externalSemaphoreFeatures & exportable:
                    raise VulkanError(
                        "vkGetPhysicalDeviceExternalSemaphoreProperties",
                        f"{self.name} cannot export {kind} semaphores as OPAQUE_FD "
                        f"(externalSemaphoreFeatures={int(ext.externalSemaphoreFeatures):#x})",
                    )

        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(pd)
        wanted = vk.VK_QUEUE_GRAPHICS_BIT | vk.VK_QUEUE_COMPUTE_BIT
        self.queue_family = next(
            (i for i, f in enumerate(families) if f.queueCount and f.queueFlags & wanted), 0
        )

        queue_info = vk.VkDeviceQueueCreateInfo(
            queueFamilyIndex=self.queue_family, queueCount=1, pQueuePriorities=[1.0]
        )
        self._device = _call(
            "vkCreateDevice",
            vk.vkCreateDevice,
            pd,
            vk.VkDeviceCreateInfo(
                pNext=vk.VkPhysicalDeviceVulkan12Features(timelineSemaphore=vk.VK_TRUE),
                pQueueCreateInfos=[queue_info],
                ppEnabledExtensionNames=enable,
            ),
            None,
        )
        self._queue = vk.vkGetDeviceQueue(self._device, self.queue_family, 0)
        if self.export:
            self._get_fd = _call(
                "vkGetDeviceProcAddr(vkGetSemaphoreFdKHR)",
                vk.vkGetDeviceProcAddr,
                self._device,
                "vkGetSemaphoreFdKHR",
            )

    # -- semaphores -------------------------------------------------------------------------

    def _live(self) -> Any:
        if self._device is None:
            raise VulkanError("VulkanDevice", "the device is closed")
        return self._device

    def _create(self, timeline: bool, initial: int) -> VulkanSemaphore:
        vk = _vk()
        device = self._live()
        head: Any = None
        if timeline:
            if not 0 <= initial < 2**64:
                raise ValueError(f"initial value {initial} is not a uint64")
            head = vk.VkSemaphoreTypeCreateInfo(
                semaphoreType=vk.VK_SEMAPHORE_TYPE_TIMELINE, initialValue=initial
            )
        if self.export:
            head = vk.VkExportSemaphoreCreateInfo(pNext=head, handleTypes=OPAQUE_FD)
        handle = _call(
            "vkCreateSemaphore",
            vk.vkCreateSemaphore,
            device,
            vk.VkSemaphoreCreateInfo(pNext=head),
            None,
        )
        semaphore = VulkanSemaphore(self, handle, timeline)
        self._semaphores.append(semaphore)
        return semaphore

    def timeline(self, initial: int = 0) -> VulkanSemaphore:
        """Create a timeline semaphore (exportable as ``OPAQUE_FD`` when :attr:`export`).

        Parameters
        ----------
        initial
            Its starting value.

        Returns
        -------
        VulkanSemaphore
            Closed with this device, or earlier by its own :meth:`VulkanSemaphore.close`.
        """
        return self._create(True, initial)

    def binary(self) -> VulkanSemaphore:
        """Create a binary semaphore (exportable as ``OPAQUE_FD`` when :attr:`export`).

        Returns
        -------
        VulkanSemaphore
            Closed with this device, or earlier by its own :meth:`VulkanSemaphore.close`.
        """
        return self._create(False, 0)

    # -- queue work -------------------------------------------------------------------------

    def _submit(self, call: str, submit: Any) -> Any:
        """Submit one batch with a fresh fence, which stays in flight until reaped."""
        vk = _vk()
        device = self._live()
        fence = _call("vkCreateFence", vk.vkCreateFence, device, vk.VkFenceCreateInfo(), None)
        try:
            _call(call, vk.vkQueueSubmit, self._queue, 1, [submit], fence)
        except BaseException:
            vk.vkDestroyFence(device, fence, None)
            raise
        self._inflight.append(fence)
        return fence

    def _wait_fences(self, fences: list[Any], timeout_s: float | None) -> bool:
        """Wait for all ``fences``; on success destroy them and forget them."""
        vk = _vk()
        if not fences:
            return True
        try:
            _call(
                "vkWaitForFences",
                vk.vkWaitForFences,
                self._device,
                len(fences),
                fences,
                vk.VK_TRUE,
                _ns(timeout_s),
            )
        except VulkanError as exc:
            if exc.detail.startswith("VkTimeout"):
                return False
            raise
        for fence in fences:
            self._inflight.remove(fence)
            vk.vkDestroyFence(self._device, fence, None)
        return True

    def _drain(self, timeout_s: float | None = _CLOSE_GRACE_S) -> bool:
        """Wait for all queue work this device submitted; whether it all finished."""
        if self._device is None:
            return True
        return self._wait_fences(list(self._inflight), timeout_s)

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the semaphores, fences, device and instance. Idempotent.

        Queue work still pending after a short grace (a ``queue_wait`` that timed out on a
        semaphore nobody signals) makes destroying anything undefined behaviour: then the
        device and instance are leaked, with a :class:`ResourceWarning`, for the process's
        exit to reclaim.
        """
        vk = _vk_module
        if vk is None:
            return
        drained = True
        if self._device is not None:
            try:
                drained = self._drain()
            except VulkanError:
                drained = False
        if drained:
            for semaphore in list(self._semaphores):
                semaphore.close()
            if self._device is not None:
                vk.vkDestroyDevice(self._device, None)
            if self._instance is not None:
                vk.vkDestroyInstance(self._instance, None)
        else:
            warnings.warn(
                f"Vulkan queue work still pending after {_CLOSE_GRACE_S} s: "
                "leaking the Vulkan device",
                ResourceWarning,
                stacklevel=2,
            )
            for semaphore in self._semaphores:
                semaphore._handle = None
        self._semaphores.clear()
        self._inflight.clear()
        self._device = self._instance = self._queue = self._get_fd = None

    def __enter__(self) -> VulkanDevice:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._device is None else f"queue family {self.queue_family}"
        return f"VulkanDevice({self.name!r}, vendor {self.vendor_id:#x}, {state})"


class VulkanSemaphore:
    """A Vulkan semaphore made by :meth:`VulkanDevice.timeline` or :meth:`VulkanDevice.binary`.

    Parameters
    ----------
    device
        The device that made it.
    handle
        The ``VkSemaphore``.
    timeline
        Whether it is a timeline semaphore (else binary).
    """

    def __init__(self, device: VulkanDevice, handle: Any, timeline: bool) -> None:
        self.device = device
        self._handle: Any = handle
        self.is_timeline = timeline

    def _live(self) -> Any:
        if self._handle is None:
            raise VulkanError("VulkanSemaphore", "the semaphore is closed")
        return self._handle

    def _need(self, timeline: bool, what: str) -> None:
        if self.is_timeline != timeline:
            kind = "timeline" if timeline else "binary"
            raise TypeError(f"{what} is for {kind} semaphores only")

    # -- export -----------------------------------------------------------------------------

    def export_fd(self) -> int:
        """Export the semaphore's payload as an opaque POSIX file descriptor.

        Returns
        -------
        int
            A new descriptor on each call; the caller owns it (CUDA's import takes ownership
            on success, otherwise ``os.close`` it).

        Raises
        ------
        VulkanError
            The device was opened with ``export=False``, or ``vkGetSemaphoreFdKHR`` failed.
        """
        vk = _vk()
        handle = self._live()
        if self.device._get_fd is None:
            raise VulkanError("vkGetSemaphoreFdKHR", "the device was opened with export=False")
        info = vk.VkSemaphoreGetFdInfoKHR(semaphore=handle, handleType=OPAQUE_FD)
        return int(_call("vkGetSemaphoreFdKHR", self.device._get_fd, self.device._live(), info))

    # -- timeline ---------------------------------------------------------------------------

    def signal(self, value: int) -> None:
        """Set a timeline semaphore's value from the host (``vkSignalSemaphore``).

        Parameters
        ----------
        value
            The new value: greater than the current one and than any pending signal.

        Raises
        ------
        ValueError
            ``value`` is not a uint64 or not above the current value.
        VulkanError
            ``vkSignalSemaphore`` failed.
        """
        vk = _vk()
        self._need(True, "signal")
        if not 0 <= value < 2**64:
            raise ValueError(f"value {value} is not a uint64")
        current = self.value()
        if value <= current:
            # Invalid usage: some drivers (lavapipe) answer it with VK_ERROR_DEVICE_LOST.
            raise ValueError(f"value {value} is not above the current value {current}")
        info = vk.VkSemaphoreSignalInfo(semaphore=self._live(), value=value)
        _call("vkSignalSemaphore", vk.vkSignalSemaphore, self.device._live(), info)

    def wait(self, value: int, timeout_s: float | None = 5.0) -> bool:
        """Wait on the host until a timeline semaphore reaches ``value`` (``vkWaitSemaphores``).

        Parameters
        ----------
        value
            The value to wait for.
        timeout_s
            How long to wait, in seconds; ``0`` polls, ``None`` waits forever.

        Returns
        -------
        bool
            Whether the value was reached (``False``: ``VK_TIMEOUT``).
        """
        vk = _vk()
        self._need(True, "wait")
        info = vk.VkSemaphoreWaitInfo(pSemaphores=[self._live()], pValues=[value])
        try:
            _call(
                "vkWaitSemaphores", vk.vkWaitSemaphores, self.device._live(), info, _ns(timeout_s)
            )
        except VulkanError as exc:
            if exc.detail.startswith("VkTimeout"):
                return False
            raise
        return True

    def value(self) -> int:
        """A timeline semaphore's current value (``vkGetSemaphoreCounterValue``)."""
        vk = _vk()
        self._need(True, "value")
        return int(
            _call(
                "vkGetSemaphoreCounterValue",
                vk.vkGetSemaphoreCounterValue,
                self.device._live(),
                self._live(),
            )
        )

    # -- binary, through the queue ----------------------------------------------------------

    def queue_signal(self) -> None:
        """Signal a binary semaphore from the device's queue.

        A ``vkQueueSubmit`` with no command buffers that signals the semaphore; it returns
        without waiting for the queue.
        """
        vk = _vk()
        self._need(False, "queue_signal")
        submit = vk.VkSubmitInfo(pSignalSemaphores=[self._live()])
        self.device._submit("vkQueueSubmit", submit)

    def queue_wait(self, timeout_s: float | None = 5.0) -> bool:
        """Make the device's queue wait on a binary semaphore; wait for that on the host.

        A ``vkQueueSubmit`` with no command buffers that waits on the semaphore (at
        ``VK_PIPELINE_STAGE_ALL_COMMANDS_BIT``) and signals a fence, then
        ``vkWaitForFences``. Vulkan requires the signal that this wait consumes (from
        :meth:`queue_signal`, or from CUDA on the imported semaphore: signal on a stream and
        synchronize it) to be submitted first. Waiting with no signal pending is invalid
        usage, and some drivers then block inside ``vkQueueSubmit``, ignoring ``timeout_s``
        (seen with Mesa's lavapipe).

        Parameters
        ----------
        timeout_s
            How long to wait for the fence, in seconds; ``None`` waits forever.

        Returns
        -------
        bool
            Whether the fence signalled. ``False`` leaves the submission pending (the
            semaphore may still be signalled later; :meth:`VulkanDevice.close` handles it).
        """
        vk = _vk()
        self._need(False, "queue_wait")
        submit = vk.VkSubmitInfo(
            pWaitSemaphores=[self._live()],
            pWaitDstStageMask=[vk.VK_PIPELINE_STAGE_ALL_COMMANDS_BIT],
        )
        fence = self.device._submit("vkQueueSubmit", submit)
        return self.device._wait_fences([fence], timeout_s)

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the semaphore (idempotent; fds exported earlier stay valid).

        It first waits briefly for the device's queue work, which may use the semaphore; if
        that is still pending, the semaphore is left to :meth:`VulkanDevice.close`.
        """
        if self._handle is None:
            return
        device = self.device
        if device._device is None:
            self._handle = None
            return
        try:
            if not device._drain():
                return
        except VulkanError:
            return
        _vk().vkDestroySemaphore(device._device, self._handle, None)
        self._handle = None
        if self in device._semaphores:
            device._semaphores.remove(self)

    def __enter__(self) -> VulkanSemaphore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "timeline" if self.is_timeline else "binary"
        state = "closed" if self._handle is None else "open"
        return f"VulkanSemaphore({kind}, {state})"
