"""What the names of host resources are made of: a backend's name and its sandboxes' ids.

Every host resource of a backend (cgroups, mounts, records, runsc containers) is named
after both, so the two patterns are one fact for every backend: the edge routes an id
to its backend, and a leak check finds a resource by its name.
"""

from __future__ import annotations

import re
from typing import Final

ID_RE: Final = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
"""A sandbox id."""
NAME_RE: Final = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")
"""A backend's name on this host (``BackendContext.name``)."""
