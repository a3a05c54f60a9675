"""The api layer: what users call, re-exported by :mod:`sharedarrays`. It imports
``importing`` and the layers below it, never the driver."""
