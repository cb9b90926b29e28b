"""The ECRecJob resource's identity: API group, version, kind and names, as the CRD and manifests spell them."""

from __future__ import annotations

GROUP = "ecrec.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ECRecJob"
PLURAL = "ecrecjobs"
SINGULAR = "ecrecjob"
SHORT_NAMES = ("ecj",)
CATEGORIES = ("ecrec",)
CRD_NAME = f"{PLURAL}.{GROUP}"
DEFAULT_JOB_NAME = "ecrec-job"
