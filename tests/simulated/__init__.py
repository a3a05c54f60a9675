"""Simulated accelerator drivers (test doubles, never imported by the library).

Each module implements the calls a backend makes, with the semantics it depends on, over host
memory shared between processes (memfd), so that the backend runs end to end across real
processes on a machine without the hardware. A backend is pointed at one by a setting
(``SHAREDARRAYS_HIP_MODULE=simulated.hip``), which spawned workers inherit.
"""
