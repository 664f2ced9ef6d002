"""megarl.rewards"""
