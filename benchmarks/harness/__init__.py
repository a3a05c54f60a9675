"""The benchmark harness (``python benchmarks/bench.py``): hand an array to a spawn Pool
worker, against every peer.

Everything runs in one process tree on one machine. The parent process creates an object,
then times ``pool.apply_async(task, (obj, read)).get()`` (what ``pool.apply`` does) with
:func:`time.perf_counter`; the worker receives the object and makes it usable.

Two task kinds:

* **handoff**: the worker receives the object and materialises the native array (for
  sharedarrays ``a.array``; for torch the tensor; for cuda.core the Buffer wrapped as a CuPy
  array; for the copy path ``cupy.asarray`` of the unpickled NumPy array), returns a tiny
  value and launches no kernel.
* **read**: the same, plus a full sum of the array, synchronised (``float(x.sum())``).

Methods (one line each in the table and the plot):

* ``floor``: an empty task with a 64-byte argument: the Pool's own round trip.
* ``copy``: ``cupy.asnumpy`` in the parent (timed), the NumPy array pickled through the Pool,
  ``cupy.asarray`` in the worker (GPU, up to 1 GiB); plain pickling of a NumPy array on the
  host.
* ``torch-warm`` / ``torch-cold``: a CUDA tensor through torch.multiprocessing's reductions
  (registered by ``import torch.multiprocessing`` in the parent): the same tensor each time,
  or a new one each time (torch's caching allocator may hand back the same segment).
* ``cuda.core-warm`` / ``cuda.core-cold``: a Buffer of an IPC-enabled
  ``DeviceMemoryResource``; the resource goes to the worker once, in the Pool's initializer
  (which registers it there), and each Buffer is sent as ``pickle.dumps(buffer)`` (timed),
  which the registry resolves on ``pickle.loads`` in the worker.
* ``shm-warm`` / ``shm-cold`` (host only): a ``multiprocessing.shared_memory.SharedMemory``
  segment attached by name in the worker and wrapped as a NumPy array.
* ``sharedarrays-warm``: the same :class:`~sharedarrays.SharedDeviceArray` again (the
  worker keeps its mapping parked between tasks); ``sharedarrays-cold``: a new array each
  repeat, created before the timer and closed after it (and the worker's parked mapping
  dropped), so each task is a first import in that worker. These use the default memory
  system (cuda-vmm on a GPU, host on the CPU).
* ``sa.ipc-warm`` / ``sa.ipc-cold`` and ``sa.pool-warm`` / ``sa.pool-cold`` (GPU only): the
  same with ``backend="cuda-ipc"`` and ``backend="cuda-pool"``.

Cold methods create the new object before the timer and release it after; warm methods
create one object per size and send it ``warmup + repeats`` times.

Like for like (issue 19): the ``warm`` and ``cold`` parts time the floor and one method of
each family (sharedarrays on each backend, torch, cuda.core; shm on the host) in interleaved
rounds, in a balanced order, in one worker that has started CUDA, CuPy and torch, and report
each method's median of per-round differences over the floor (:mod:`~harness.rounds`);
the ``many`` part hands 10,000 small arrays (and, on CUDA, 10,000 torch tensors) in one task
to that kind of worker, alternated. Also measured: copy-kernel bandwidth in the worker on
shared memory against a plain CuPy (NumPy) array; and fan-out of one array to 1, 4 and 16
workers at once.

The package, one concern per module (it lives in the repository, not in the library: nothing
in ``sharedarrays`` imports it; ``benchmarks/bench.py`` puts its folder on ``sys.path``):

* :mod:`~harness.sizes`: ``"256M"`` <-> bytes;
* :mod:`~harness.config`: what a run measures (``Config``), the options and
  their parsing;
* :mod:`~harness.environment`: date, machine, GPU and versions for the JSON;
* :mod:`~harness.worker`: the tasks the Pool's workers run;
* :mod:`~harness.handoffs`: the rounds' ``bound`` and ``safe`` entries (what bounds a figure);
* :mod:`~harness.methods`: each peer's parent side (make, send, free);
* :mod:`~harness.rounds`: interleaved rounds and the overhead over the floor;
* :mod:`~harness.pools`: spawn pools, timed cases, and the state a run's parts share;
* :mod:`~harness.overhead`: the ``warm`` and ``cold`` parts (interleaved rounds);
* :mod:`~harness.parts`: the ``many``, ``bandwidth``, ``steps`` and ``scaling`` parts;
* :mod:`~harness.measure`: the run through the method x size table and every part;
* :mod:`~harness.dask`: the ``dask`` part;
* :mod:`~harness.report`: targets, table and plot;
* :mod:`~harness.command`: the entry point (``main``, run by ``benchmarks/bench.py``).

It uses the public API (``sa.empty``, ``sa.load``, pickling an array, ``close``) and these
internals, which it measures or needs to measure fairly:

* ``SharedDeviceArray.allocation`` (``.id``, ``.size``: the memory the small arrays take;
  ``.backend.import_sync``: a step of a warm load) and ``SharedDeviceArray.__reduce__``
  (the payload and sync token a worker receives);
* ``sharedarrays.protocol.payload.Payload.from_bytes`` (a step of a warm load);
* ``sharedarrays.memory.drop_parked`` (a worker forgets its parked mappings, so
  that each cold repeat is a first import);
* ``sharedarrays.backends.kind_unusable`` and ``sharedarrays.backends.device.parse_device``
  (``--device``).
"""
