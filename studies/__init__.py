"""The study runner's libraries (study.py is the script): a study's plan and its report."""
