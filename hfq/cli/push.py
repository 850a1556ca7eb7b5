"""`hfq push DIR REPO`: upload a saved hfq model or adapter folder to the Hub as it is (weights, tokenizer files,
README.md), adding hfq's model card when the folder has none (or PEFT's empty template) and
pointing a card hfq wrote for another repo id (trainer.save_model names the output folder) at REPO."""
from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("folder", metavar="DIR", help="a folder written by save_pretrained / hfq.hub.save_for_hub")
    p.add_argument("repo", metavar="REPO", help="Hub repository id, e.g. me/qwen-nvfp4")
    p.add_argument("--private", action="store_true", help="create the repository as private")
    p.add_argument("--token", default=None, help="Hub token (default: HF_TOKEN or the `hf auth login` token)")
    p.add_argument("--base-model", default=None, metavar="ID",
                   help="the Hub id the model derives from, for the card hfq adds (a saved folder does not record it)")


def _http_error(hub_error) -> type:
    """The HTTP client's base error that huggingface_hub's own derives from (httpx's or httpx2's HTTPError, whose
    connection errors are not OSErrors), else OSError."""
    return next((c for c in hub_error.__mro__[1:] if c.__name__ == "HTTPError"), OSError)


def main(args) -> int:
    import os

    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalTokenNotFoundError
    from huggingface_hub.utils import validate_repo_id

    from hfq import hub

    try:
        validate_repo_id(args.repo)
    except HFValidationError as e:
        raise SystemExit(f"hfq push: REPO {args.repo!r} is not a valid Hub repository id: {e}") from None
    if not os.path.isdir(args.folder):
        raise SystemExit(f"hfq push: DIR {args.folder!r} is not a directory")
    try:
        hub.check_push(args.repo, args.token)
    except LocalTokenNotFoundError as e:
        raise SystemExit(f"hfq push: no Hub token: {e}") from None
    had_card = os.path.isfile(os.path.join(args.folder, "README.md"))
    try:
        url = hub.upload_folder(args.folder, args.repo, private=args.private, token=args.token,
                                base_model=args.base_model)
    except ValueError as e:
        raise SystemExit(f"hfq push: DIR: {e}") from None
    except (OSError, _http_error(HfHubHTTPError)) as e:  # offline mode, connection and HTTP errors
        raise SystemExit(f"hfq push: upload to {args.repo!r} failed: {e}") from None
    print(f"pushed {os.path.abspath(args.folder)} to {url}" + ("" if had_card else " (added README.md model card)"))
    return 0
