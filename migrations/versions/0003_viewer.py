"""viewer keys and trainer step metrics (issue 16)

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24

viewer_keys: read-only keys of the /ui pages (hashed). ui_sessions: signed-in /ui cookies (the token hashed).
training_steps: each trainer step's figures, by the version it published. trained_samples: each trained
session's advantage and the version it was trained in.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('viewer_keys',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('name', sa.String(length=200), nullable=False),
    sa.Column('key_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('revoked_at', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_viewer_keys')),
    sa.UniqueConstraint('key_hash', name=op.f('uq_viewer_keys_key_hash'))
    )
    op.create_table('ui_sessions',
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('viewer_key_id', sa.String(length=64), nullable=True),
    sa.Column('session_id', sa.String(length=64), nullable=True),
    sa.Column('credential_hash', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('expires_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('token_hash', name=op.f('pk_ui_sessions'))
    )
    with op.batch_alter_table('ui_sessions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_ui_sessions_viewer_key_id'), ['viewer_key_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_ui_sessions_expires_at'), ['expires_at'], unique=False)

    op.create_table('training_steps',
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('reported_at', sa.Float(), nullable=False),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('version', name=op.f('pk_training_steps'))
    )
    with op.batch_alter_table('training_steps', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_training_steps_step'), ['step'], unique=False)

    op.create_table('trained_samples',
    sa.Column('session_id', sa.String(length=64), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('group_id', sa.String(length=64), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('advantage', sa.Float(), nullable=False),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('sequences', sa.Integer(), nullable=False),
    sa.Column('loss_tokens', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('session_id', 'version', name=op.f('pk_trained_samples'))
    )
    with op.batch_alter_table('trained_samples', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_trained_samples_version'), ['version'], unique=False)
        batch_op.create_index(batch_op.f('ix_trained_samples_group_id'), ['group_id'], unique=False)


def downgrade() -> None:
    op.drop_table('trained_samples')
    op.drop_table('training_steps')
    op.drop_table('ui_sessions')
    op.drop_table('viewer_keys')
