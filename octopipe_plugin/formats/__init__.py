"""Readers and writers of the three interchange documents of docs/formats.md."""

from .cluster import CLUSTER_FORMAT, Cluster, Link, cluster_from_dict, cluster_to_dict, read_cluster, write_cluster
from .fingerprint import bind_plan, check_plan_binding, cluster_fingerprint, idle_devices, model_fingerprint
from .model import MODEL_FORMAT, Layer, Model, model_from_dict, model_to_dict, read_model, write_model
from .plan import PLAN_FORMAT, Plan, Stage, plan_from_dict, plan_to_dict, read_plan, validate_plan, write_plan

__all__ = [
    "CLUSTER_FORMAT", "Cluster", "Link", "cluster_from_dict", "cluster_to_dict", "read_cluster", "write_cluster",
    "MODEL_FORMAT", "Layer", "Model", "model_from_dict", "model_to_dict", "read_model", "write_model",
    "bind_plan", "check_plan_binding", "cluster_fingerprint", "idle_devices", "model_fingerprint",
    "PLAN_FORMAT", "Plan", "Stage", "plan_from_dict", "plan_to_dict", "read_plan", "validate_plan", "write_plan",
]
