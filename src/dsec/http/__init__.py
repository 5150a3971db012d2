"""HTTP as DSec speaks it, below every service and the SDK: the lean HTTP/1.1 client
(``client``), the fast routes and bounded request heads of the servers (``fastroute``,
``limits``), the event loop they run on (``loop``), and bearer tokens (``auth``)."""

ENDED_HEADER = "dsec-ended"
"""On a ``DELETE /v1/sandboxes/{id}`` answer (204) for a sandbox that had ended before the call:
how it ended (``stopped (expired)``). Absent when the call stopped it. (Here, not in the
control plane: the CLI's lean client reads it and imports nothing of the servers.)"""
