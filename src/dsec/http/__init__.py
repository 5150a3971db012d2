"""HTTP as DSec speaks it, below every service and the SDK: the lean HTTP/1.1 client
(``client``), the fast routes and bounded request heads of the servers (``fastroute``,
``limits``), the event loop they run on (``loop``), and bearer tokens (``auth``)."""
