"""What the backends that run sandboxes on this host (container, gVisor) do the same way.

Each module here is one concept both use, written once: image layers stacked and pinned
(:mod:`layers`), a command checked before it starts (:mod:`command`) and its output
collected (:mod:`output`), non-blocking fd plumbing (:mod:`fdio`), cgroup control files
(:mod:`cgroupfs`), native helpers compiled (:mod:`native`), what host resources are named
after (:mod:`names`). Nothing here imports a backend; a backend imports these, never
another backend's internals for them.
"""
