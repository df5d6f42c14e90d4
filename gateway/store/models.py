"""The store's tables (SQLAlchemy 2.0 typed ORM). Schema changes only through Alembic revisions.

groups -> sessions -> turns, plus leases (batches), the weight-version state and the backend registry.
Token arrays are little-endian binary (`rollway_common.wire.pack`), never JSON lists. Times are epoch seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Index, Integer, LargeBinary, MetaData, String, false
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Group(Base):
    __tablename__ = "groups"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    task: Mapped[Any] = mapped_column(JSON)
    n_samples: Mapped[int] = mapped_column(Integer)
    # open -> complete -> leased -> trained | dropped (drop_reason)
    state: Mapped[str] = mapped_column(String(16), index=True)
    drop_reason: Mapped[str | None] = mapped_column(String(64))
    is_eval: Mapped[bool] = mapped_column(Boolean, default=False)
    sampling: Mapped[dict[str, Any]] = mapped_column(JSON)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSON)
    created_at: Mapped[float] = mapped_column(Float)
    completed_at: Mapped[float | None] = mapped_column(Float)
    batch_id: Mapped[str | None] = mapped_column(String(64), index=True)
    trained_version: Mapped[int | None] = mapped_column(Integer)

    # The viewer's groups page: its order and keyset cursor (migration 0004).
    __table_args__ = (Index("ix_groups_created_at_id", "created_at", "id"),)


class AdmissionCount(Base):
    """One row (id 1): how many groups the staleness admission counts (not eval; open, complete, leased or
    trained), kept by triggers on groups (migration 0005), so admission reads a row, not a count of every group."""

    __tablename__ = "admission_counts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    groups: Mapped[int] = mapped_column(Integer)


class Session(Base):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    group_id: Mapped[str] = mapped_column(ForeignKey("groups.id"), index=True)
    replica: Mapped[int] = mapped_column(Integer)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # active -> finished | abandoned
    state: Mapped[str] = mapped_column(String(16), index=True)
    end_reason: Mapped[str | None] = mapped_column(String(128))
    reward: Mapped[float | None] = mapped_column(Float)
    turn_count: Mapped[int] = mapped_column(Integer, default=0)
    """Bumped with each stored turn; lets a gateway know its cached view of the session is current."""
    created_at: Mapped[float] = mapped_column(Float)
    last_active_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)

    # The viewer's mean-reward filter and reward strips read a group's rewards from this index alone (0004).
    __table_args__ = (Index("ix_sessions_group_id_reward", "group_id", "reward"),)


class Turn(Base):
    __tablename__ = "turns"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id"))
    seq: Mapped[int] = mapped_column(Integer)
    parent_id: Mapped[str | None] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(32))
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    """messages (as received, normalised to dicts), tools, sampling asked and sampling used; for a turn that
    extends its parent, a delta on the parent's request (`gateway/store/requests.py`: read whole through it)."""
    reply: Mapped[dict[str, Any]] = mapped_column(JSON)
    """The assistant message returned (content, reasoning_content, tool_calls)."""
    prompt_ids: Mapped[bytes] = mapped_column(LargeBinary)
    """int32; a delta on parent's prompt+completion when parent_id is set, else the whole prompt."""
    prompt_len: Mapped[int] = mapped_column(Integer)
    completion_ids: Mapped[bytes] = mapped_column(LargeBinary)
    logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    versions: Mapped[bytes] = mapped_column(LargeBinary)
    temperature: Mapped[float] = mapped_column(Float)
    finish_reason: Mapped[str] = mapped_column(String(32))
    continuity: Mapped[str] = mapped_column(String(16))
    chain_reason: Mapped[str | None] = mapped_column(String(64))
    client_disconnected: Mapped[bool] = mapped_column(Boolean, default=False)
    reward: Mapped[float | None] = mapped_column(Float)
    timings: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float)
    constrained: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    """Decoded under a grammar (forced tool_choice, response_format): its tokens are not samples of the policy
    the trainer recomputes, so they are kept out of the loss by default (gateway/samples.py)."""

    __table_args__ = (Index("ix_turns_session_seq", "session_id", "seq", unique=True),)


@dataclass(slots=True)
class TurnRecord:
    """One turn as the gateway records it (`Store.insert_turn`): a value for each column of `turns` but those
    the store sets (`session_id`, `seq`, `created_at`) and `reward` (set later, by a reward call). Token
    arrays are packed (`rollway_common.wire.pack`); the meaning of each field is its column's (Turn above)."""

    id: str
    parent_id: str | None
    endpoint: str
    request: dict[str, Any]
    reply: dict[str, Any]
    prompt_ids: bytes
    prompt_len: int
    completion_ids: bytes
    logprobs: bytes
    versions: bytes
    temperature: float
    finish_reason: str
    continuity: str
    chain_reason: str | None
    timings: dict[str, Any]
    client_disconnected: bool = False
    constrained: bool = False

    def values(self) -> dict[str, Any]:
        """Column name -> value, for an insert through SQLAlchemy."""
        return {name: getattr(self, name) for name in TURN_RECORD_FIELDS}


TURN_RECORD_FIELDS: tuple[str, ...] = tuple(TurnRecord.__dataclass_fields__)
if unknown := set(TURN_RECORD_FIELDS) - set(Turn.__table__.columns.keys()):  # a rename of one without the other
    raise RuntimeError(f"TurnRecord fields that are no column of turns: {sorted(unknown)}")


class Batch(Base):
    """A trainer's lease on a set of complete groups."""

    __tablename__ = "batches"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    # leased -> acked | expired
    state: Mapped[str] = mapped_column(String(16), index=True)
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)
    trainer_version: Mapped[int] = mapped_column(Integer)


class WeightState(Base):
    """One row per published version; the highest is current. Version 0 is the starting weights."""

    __tablename__ = "weight_versions"
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_path: Mapped[str] = mapped_column(String(1024))
    batch_id: Mapped[str | None] = mapped_column(String(64))
    published_at: Mapped[float] = mapped_column(Float)
    failed_backends: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class BackendRow(Base):
    __tablename__ = "backends"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    url: Mapped[str] = mapped_column(String(1024), unique=True)
    created_at: Mapped[float] = mapped_column(Float)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    note: Mapped[str | None] = mapped_column(String(512))


class Setting(Base):
    """Small key/value state every gateway process must agree on (e.g. groups_per_step, eta)."""

    __tablename__ = "settings"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[Any] = mapped_column(JSON)


class ViewerKey(Base):
    """A read-only key for the /ui pages (issue 16). Only its SHA-256 is kept; revoking sets revoked_at."""

    __tablename__ = "viewer_keys"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float)


class UiSession(Base):
    """A signed-in /ui cookie: the token's SHA-256, who signed in, and until when. Server-side, so a sign-out,
    a revoked viewer key or a changed admin key ends it at once, on every gateway of the store."""

    __tablename__ = "ui_sessions"
    token_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    role: Mapped[str] = mapped_column(String(16))
    viewer_key_id: Mapped[str | None] = mapped_column(String(64), index=True)
    session_id: Mapped[str | None] = mapped_column(String(64))
    credential_hash: Mapped[str] = mapped_column(String(64))
    """SHA-256 of the key used to sign in: an admin cookie stops working once the admin key changes."""
    created_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float, index=True)


class TrainingStep(Base):
    """One trainer step as the trainer reported it (POST /v1/training/steps), keyed by the version it published:
    a retried report replaces its row."""

    __tablename__ = "training_steps"
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, index=True)
    created_at: Mapped[float] = mapped_column(Float)
    """When the trainer finished the step (its clock)."""
    reported_at: Mapped[float] = mapped_column(Float)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    """Name -> number: loss, kl, entropy, clip_frac, grad_norm, lr, reward_mean/std, tokens, *_time_s, ..."""


class TrainedSample(Base):
    """A session trained in a step: its advantage (token mean over its loss tokens) and the version it trained."""

    __tablename__ = "trained_samples"
    session_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True, index=True)
    group_id: Mapped[str] = mapped_column(String(64), index=True)
    step: Mapped[int] = mapped_column(Integer)
    advantage: Mapped[float] = mapped_column(Float)
    reward: Mapped[float | None] = mapped_column(Float)
    sequences: Mapped[int] = mapped_column(Integer)
    loss_tokens: Mapped[int] = mapped_column(Integer)
