"""glm53.models"""
