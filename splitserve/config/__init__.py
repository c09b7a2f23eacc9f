"""The deployment manifest (YAML, pydantic): see manifest.py."""

from splitserve.config.manifest import Manifest, ManifestError, dump_manifest, load_manifest, parse_manifest

__all__ = ["Manifest", "ManifestError", "dump_manifest", "load_manifest", "parse_manifest"]
