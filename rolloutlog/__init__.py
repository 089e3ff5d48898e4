"""rolloutlog: an event-sourced checkpoint log for reinforcement-learning rollouts."""

__version__ = "0.1.0"
