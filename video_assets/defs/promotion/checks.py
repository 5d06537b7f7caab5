"""Asset checks of the promotion table: generated from its key."""

from video_assets.core.tables import PROMOTIONS
from video_assets.defs.common import table_checks

promotion_checks = [table_checks(PROMOTIONS)]
