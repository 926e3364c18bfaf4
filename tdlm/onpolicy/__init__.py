"""On-policy rounds over Ray and DeepSpeed: roll in with the student, roll out with the frozen backbone, train on a
mix, sync the adapter (:mod:`tdlm.onpolicy.job`; records: :mod:`tdlm.data.onpolicy`)."""

from tdlm.onpolicy.config import OnPolicyConfig
from tdlm.onpolicy.job import Job

__all__ = ["Job", "OnPolicyConfig"]
