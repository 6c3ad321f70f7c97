"""Registered models: (tenant, model name) -> spec and namespace, persisted under `data_dir`.

Registration is idempotent; a different spec under the same name is a `ModelConflict`. The
registry is saved as `models.json` (written atomically) so a restarted sidecar still knows the
models whose pages its disk tier holds.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass

from kvstore.config import ModelSpec
from kvstore.errors import ModelConflict, ModelNotFound
from kvstore.keys import namespace_key

log = logging.getLogger("kvstore.registry")


@dataclass(frozen=True)
class Model:
    name: str
    tenant: str | None
    spec: ModelSpec
    namespace: bytes


class ModelRegistry:
    def __init__(self, data_dir: str | None):
        self._path = os.path.join(data_dir, "models.json") if data_dir else None
        self._models: dict[tuple[str | None, str], Model] = {}
        self.specs_by_namespace: dict[bytes, ModelSpec] = {}
        # Only ever added to (like specs): placement counts a page's bytes against this tenant.
        self.tenants_by_namespace: dict[bytes, str | None] = {}
        self.models_by_namespace: dict[bytes, Model] = {}  # only ever added to: KV events name a page's model
        if self._path and os.path.exists(self._path):
            self._load(self._path)

    def _load(self, path: str) -> None:
        try:
            with open(path) as f:
                entries = json.load(f)
            for entry in entries:
                self._add(entry["name"], entry["tenant"], ModelSpec.from_dict(entry["spec"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # A damaged registry loses registrations, not pages: re-registering restores them.
            log.warning("model registry %s unreadable (%s); starting empty", self._path, exc)

    def _save(self) -> None:
        if not self._path:
            return
        entries = [{"name": m.name, "tenant": m.tenant, "spec": m.spec.to_dict()} for m in self._models.values()]
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self._path), prefix=".models.")
        with os.fdopen(fd, "w") as f:
            json.dump(entries, f, indent=1)
        os.replace(tmp, self._path)

    def _add(self, name: str, tenant: str | None, spec: ModelSpec) -> Model:
        model = Model(name, tenant, spec, namespace_key(name, spec.fingerprint, tenant))
        self._models[(tenant, name)] = model
        self.specs_by_namespace[model.namespace] = spec
        self.tenants_by_namespace[model.namespace] = tenant
        self.models_by_namespace[model.namespace] = model
        return model

    def register(self, name: str, spec: ModelSpec, tenant: str | None) -> tuple[Model, bool]:
        """The model, and whether this call created it."""
        existing = self._models.get((tenant, name))
        if existing is not None:
            if existing.spec != spec:
                raise ModelConflict(
                    f"model: {name!r} is registered with a different spec ({_diff(existing.spec, spec)}); "
                    f"drop it first or use another name", field="model")
            return existing, False
        model = self._add(name, tenant, spec)
        self._save()
        return model, True

    def find(self, name: str, tenant: str | None) -> Model | None:
        """The registration of `name`, or None (a name that is registered was validated then)."""
        return self._models.get((tenant, name))

    def get(self, name: str, tenant: str | None) -> Model:
        model = self._models.get((tenant, name))
        if model is None:
            raise ModelNotFound(f"model: {name!r} is not registered (PUT /v1/models/{name} or register_model first)",
                                field="model")
        return model

    def remove(self, name: str, tenant: str | None) -> Model:
        model = self.get(name, tenant)
        del self._models[(tenant, name)]
        self._save()
        return model


def _diff(a: ModelSpec, b: ModelSpec) -> str:
    da, db = a.to_dict(), b.to_dict()
    return ", ".join(f"{k}: {da[k]!r} registered, {db[k]!r} given" for k in da if da[k] != db[k])
