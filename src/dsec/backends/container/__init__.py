"""The container backend: namespaces, cgroups v1, overlay over shared EROFS layers.

Privileged code lives in small modules: ``native/*.c``, the dsec-spawner (clone, mounts,
setns, seccomp, capabilities; ``wire`` builds its requests), ``cgroups`` (v1 hierarchy), ``fsops`` (host-side
file access confined with openat2). ``runtime`` ties them together.
"""
