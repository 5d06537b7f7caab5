"""Alert delivery: each new alert sent once to each configured webhook, retried until it is accepted."""
