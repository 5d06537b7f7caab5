"""Asset checks of the routed tables: generated from their keys."""

from video_assets.core.tables import ALERTS, REVIEW_QUEUE
from video_assets.defs.common import table_checks

routing_checks = [table_checks(ALERTS), table_checks(REVIEW_QUEUE)]
