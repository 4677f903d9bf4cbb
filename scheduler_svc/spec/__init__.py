"""Speculative decoding without a draft model: proposers that guess a request's next tokens
from its own text (n-gram prompt lookup, suffix decoding), the per-request draft length from
recent acceptance, and `--speculative-config` parsing. Token ids only, no torch.
docs/speculative.md has the design, including how drafts are to be wired into steps."""

from scheduler_svc.spec.config import SpeculativeConfig, parse_speculative_config
from scheduler_svc.spec.ngram import NgramProposer
from scheduler_svc.spec.proposer import Proposer, SpecRequest
from scheduler_svc.spec.suffix import SuffixProposer
from scheduler_svc.spec.tracker import AcceptanceTracker, TrackerSettings

__all__ = [
    "AcceptanceTracker",
    "NgramProposer",
    "Proposer",
    "SpecRequest",
    "SpeculativeConfig",
    "SuffixProposer",
    "TrackerSettings",
    "parse_speculative_config",
]
