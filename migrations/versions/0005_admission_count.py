"""admission count: the groups the staleness admission counts, kept by triggers (issue 13)

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-25

Admission refuses a new training group once (eta + v + 1) * B groups count: groups not dropped and not eval
(states open, complete, leased, trained). It counted them with count(*) at every group creation, a scan that
grows with every group ever trained (SQLite: 0.5 ms at 5,000 groups, 15 ms at 100,000). admission_counts holds
that number in one row, kept by triggers on groups (insert, a change of state or is_eval, delete), so every
writer, every gateway and any tool that writes groups keeps it right; admission reads one row. Its value starts
as the count of the groups already there.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

COUNTED = "('open', 'complete', 'leased', 'trained')"
NEW = f"(NEW.state IN {COUNTED} AND NOT NEW.is_eval)"
OLD = f"(OLD.state IN {COUNTED} AND NOT OLD.is_eval)"
ADD = "UPDATE admission_counts SET groups = groups + {} WHERE id = 1"

SQLITE = [
    f"CREATE TRIGGER groups_admission_insert AFTER INSERT ON groups WHEN {NEW} BEGIN {ADD.format(1)}; END",
    f"CREATE TRIGGER groups_admission_delete AFTER DELETE ON groups WHEN {OLD} BEGIN {ADD.format(-1)}; END",
    f"CREATE TRIGGER groups_admission_update AFTER UPDATE OF state, is_eval ON groups WHEN {NEW} != {OLD} "
    f"BEGIN {ADD.format(f'CASE WHEN {NEW} THEN 1 ELSE -1 END')}; END",
]
SQLITE_DROP = ["DROP TRIGGER IF EXISTS groups_admission_insert", "DROP TRIGGER IF EXISTS groups_admission_delete",
               "DROP TRIGGER IF EXISTS groups_admission_update"]

POSTGRES = [
    f"""CREATE FUNCTION groups_admission_count() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE delta integer := 0;
BEGIN
  IF TG_OP IN ('INSERT', 'UPDATE') AND {NEW} THEN delta := delta + 1; END IF;
  IF TG_OP IN ('DELETE', 'UPDATE') AND {OLD} THEN delta := delta - 1; END IF;
  IF delta <> 0 THEN {ADD.format('delta')}; END IF;
  RETURN NULL;
END $$""",
    "CREATE TRIGGER groups_admission_count AFTER INSERT OR DELETE OR UPDATE OF state, is_eval ON groups "
    "FOR EACH ROW EXECUTE FUNCTION groups_admission_count()",
]
POSTGRES_DROP = ["DROP TRIGGER IF EXISTS groups_admission_count ON groups",
                 "DROP FUNCTION IF EXISTS groups_admission_count()"]


def upgrade() -> None:
    op.create_table(
        'admission_counts',
        sa.Column('id', sa.Integer(), nullable=False),
        sa.Column('groups', sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint('id', name=op.f('pk_admission_counts')),
    )
    op.execute(f"INSERT INTO admission_counts (id, groups) SELECT 1, count(*) FROM groups "
               f"WHERE state IN {COUNTED} AND NOT is_eval")
    for statement in POSTGRES if op.get_bind().dialect.name == "postgresql" else SQLITE:
        op.execute(statement)


def downgrade() -> None:
    for statement in POSTGRES_DROP if op.get_bind().dialect.name == "postgresql" else SQLITE_DROP:
        op.execute(statement)
    op.drop_table('admission_counts')
