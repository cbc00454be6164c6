"""The one lock around every use of the DSL that may run from several threads (compiles, the
occupancy query's probe kernel): CuTeDSL is not thread-safe. It sits below ``arch`` and
``compile``, which both take it."""
import threading

DSL_LOCK = threading.RLock()
