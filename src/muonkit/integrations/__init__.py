"""Integrations with the frameworks users train in. Each imports its framework lazily and fails
with an ImportError naming the extra to install."""
