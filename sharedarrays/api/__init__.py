"""The api layer: what users call, re-exported by :mod:`sharedarrays`.

``creation`` and ``options`` (empty, zeros, ones, full, from_array; one frozen
:class:`~sharedarrays.api.options.CreationOptions`), ``array`` (SharedDeviceArray: views and
pickling), ``named`` and ``keeping`` (names and parking, through the keeper), ``pool`` (Pool,
ProcessPoolExecutor), ``semaphore`` (Timeline, ExternalSemaphore), ``views`` (the live
views the widgets read) and ``widgets/`` (the memory map). It imports ``importing`` and the
layers below it, never the driver.
"""
