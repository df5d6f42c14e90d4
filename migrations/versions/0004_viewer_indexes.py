"""viewer indexes: the groups and sessions pages' queries (issue 16)

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24

ix_groups_created_at_id (created_at, id): the groups page's order and keyset cursor, so any page, the last
included, is a range read of the index instead of a sort of every group. ix_sessions_group_id_reward
(group_id, reward): covers a group's sessions' rewards, so the mean-reward filter reads the index alone, and
a page's reward strips come from it. Neither column changes when a turn is recorded (a turn insert updates
sessions.turn_count and last_active_at only), so recording writes no more index entries than before.
"""

from __future__ import annotations

from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.create_index('ix_groups_created_at_id', ['created_at', 'id'], unique=False)
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.create_index('ix_sessions_group_id_reward', ['group_id', 'reward'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.drop_index('ix_sessions_group_id_reward')
    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.drop_index('ix_groups_created_at_id')
