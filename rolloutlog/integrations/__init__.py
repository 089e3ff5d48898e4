"""Adapters that let real Gyms' own servers be rolloutlog participants (NeMo Gym first)."""
