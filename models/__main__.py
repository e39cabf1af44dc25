"""python -m models --list: the registered backbones with their parameter counts."""
import argparse

from models import build_rgb_backbone, registered_names


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m models", description=__doc__)
    parser.add_argument("--list", action="store_true", help="print the registered backbones")
    parser.parse_args()
    for name in registered_names():
        params = sum(p.numel() for p in build_rgb_backbone(name).parameters())
        print(f"{name:14s} {params / 1e6:8.2f} M parameters (backbone, without the head)")


if __name__ == "__main__":
    main()
