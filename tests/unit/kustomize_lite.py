"""A small kustomize for the subset of it that ``deploy/kubernetes`` uses, so the manifests'
tests run where neither ``kustomize`` nor ``kubectl`` is installed.

Where one of them is, the tests render with it and check that this gives the same objects
(``test_deploy_kubernetes.py``), so the two cannot drift apart unseen. What is not in the
subset is refused (:class:`Unsupported`), never silently ignored: a kustomization that
starts using a new feature fails here until the feature is added and checked against the
real renderer.

The subset: ``resources`` (files and directories holding a kustomization), ``namespace``,
``labels`` (``pairs`` with ``includeSelectors: false``; ``includeTemplates``),
``configMapGenerator`` (``files``; only with ``generatorOptions.disableNameSuffixHash``)
and ``images`` (``name`` with ``newName`` and/or ``newTag``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "resources", "labels", "configMapGenerator",
                      "generatorOptions", "images"}
CLUSTER_SCOPED = {"Namespace", "PriorityClass", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                  "StorageClass", "CustomResourceDefinition", "RuntimeClass", "ValidatingWebhookConfiguration",
                  "MutatingWebhookConfiguration", "IngressClass", "CSIDriver", "Node"}
"""Kinds the namespace transformer leaves alone (kustomize knows them from the API's schema)."""
TEMPLATED = {"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job", "ReplicationController"}
"""Kinds with a pod template at ``spec.template`` (labels' ``includeTemplates``)."""


class Unsupported(ValueError):
    """The kustomization uses something outside this renderer's subset."""


def build(path: Path) -> list[dict[str, Any]]:
    """The objects ``kustomize build path`` gives (in no particular order)."""
    kfile = path / "kustomization.yaml"
    if not kfile.is_file():
        raise Unsupported(f"{path}: no kustomization.yaml")
    k = yaml.safe_load(kfile.read_text()) or {}
    extra = set(k) - KUSTOMIZATION_KEYS
    if extra:
        raise Unsupported(f"{kfile}: {', '.join(sorted(extra))} not supported by kustomize_lite")
    objects: list[dict[str, Any]] = []
    for ref in k.get("resources", []):
        target = (path / ref).resolve()
        if target.is_dir():
            objects += build(target)
        else:
            objects += [d for d in yaml.safe_load_all(target.read_text()) if d]
    objects += _generated(path, k)
    if "namespace" in k:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = k["namespace"]
    for spec in k.get("labels", []):
        _label(objects, spec)
    for image in k.get("images", []):
        _image(objects, image)
    return objects


def _generated(path: Path, k: dict[str, Any]) -> list[dict[str, Any]]:
    gens = k.get("configMapGenerator", [])
    if not gens:
        return []
    options = k.get("generatorOptions", {})
    if set(options) != {"disableNameSuffixHash"} or options["disableNameSuffixHash"] is not True:
        raise Unsupported("configMapGenerator needs generatorOptions: {disableNameSuffixHash: true} here "
                          "(no hash suffixes, no name references to rewrite)")
    out = []
    for gen in gens:
        if set(gen) - {"name", "files"}:
            raise Unsupported(f"configMapGenerator {gen.get('name')}: only name and files")
        data = {}
        for f in gen.get("files", []):
            if "=" in f:
                raise Unsupported(f"configMapGenerator file {f!r}: KEY=PATH not supported")
            data[Path(f).name] = (path / f).read_text()
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    return out


def _label(objects: list[dict[str, Any]], spec: dict[str, Any]) -> None:
    if set(spec) - {"pairs", "includeSelectors", "includeTemplates"}:
        raise Unsupported(f"labels entry {spec}: only pairs, includeSelectors, includeTemplates")
    if spec.get("includeSelectors"):
        raise Unsupported("labels with includeSelectors: true (selectors would change)")
    pairs = spec["pairs"]
    for obj in objects:
        obj.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
        if spec.get("includeTemplates") and obj["kind"] in TEMPLATED:
            tmeta = obj["spec"]["template"].setdefault("metadata", {})
            tmeta.setdefault("labels", {}).update(pairs)
            for claim in obj["spec"].get("volumeClaimTemplates", []) if obj["kind"] == "StatefulSet" else []:
                claim.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)


def _containers(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict))
            else:
                yield from _containers(value)
    elif isinstance(node, list):
        for item in node:
            yield from _containers(item)


def split_image(image: str) -> tuple[str, str]:
    """``(name, suffix)`` where suffix is ``:tag``, ``@digest`` or ``""``."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def _image(objects: list[dict[str, Any]], spec: dict[str, Any]) -> None:
    if set(spec) - {"name", "newName", "newTag"}:
        raise Unsupported(f"images entry {spec}: only name, newName, newTag")
    for obj in objects:
        for c in _containers(obj):
            name, suffix = split_image(c.get("image", ""))
            if name != spec["name"]:
                continue
            if "newTag" in spec:
                suffix = f":{spec['newTag']}"
            c["image"] = spec.get("newName", name) + suffix


def key(obj: dict[str, Any]) -> tuple[str, str, str, str]:
    meta = obj.get("metadata", {})
    return obj["apiVersion"], obj["kind"], meta.get("namespace", ""), meta["name"]


def by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    out: dict[tuple[str, str, str, str], dict[str, Any]] = {}
    for obj in objects:
        k = key(obj)
        if k in out:
            raise ValueError(f"two objects {k}")
        out[k] = copy.deepcopy(obj)
    return out
