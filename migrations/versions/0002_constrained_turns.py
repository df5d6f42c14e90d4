"""constrained turns (issue 15 forced tool choice)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-24

turns.constrained: the turn was decoded under a grammar (a forced tool_choice, response_format); its tokens
are kept out of the loss by default.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('turns', schema=None) as batch_op:
        batch_op.add_column(sa.Column('constrained', sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table('turns', schema=None) as batch_op:
        batch_op.drop_column('constrained')
