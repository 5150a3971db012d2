"""The README's main job: agent-style rollouts against a real DSec on this machine."""
