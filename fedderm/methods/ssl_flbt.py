"""SSL-FL-BT (paper 004 §III): MSG-GAN pseudo images, server-side pre-training, then FL-BT;
``strategies/ssl_flbt.py``, ``clients/ssl_flbt.py``, ``fedderm/ssl_pseudo.py``; docs/methods/flbt.md.
The ranges of its ``ssl.*`` keys are checked with FL-BT's (``methods/flbt.py``)."""

from fedderm.methods import Method, register_method

SSL_PRETRAIN = ("pseudo", "local", "federated")  # where stage 1 runs (004 Tables V-X)
SSL_TASKS = ("both", "centre", "restoration", "simclr")  # ssl_pseudo.MULTITASK_TASKS + SimCLR
SSL_FINETUNE = ("flbt", "fedavg", "local")
SSL_OPTIONS = {
    "ssl.pretrain": "pseudo",  # pseudo: server SSL on GAN images | local: each centre alone | federated
    "ssl.pseudo-per-centre": 1000,
    "ssl.gan-steps": 300,
    "ssl.gan-batch": 16,
    "ssl.gan-width": 32,
    "ssl.gan-latent": 64,
    "ssl.gan-lr": 0.003,
    "ssl.fid-select": False,  # rank GAN snapshots by FID to the centre's real images
    "ssl.fid-checkpoints": 4,  # generator snapshots compared (evenly spaced over gan-steps)
    "ssl.fid-keep": 1,  # best snapshots whose images are uploaded
    "ssl.fid-features": "",  # "" = fixed random CNN (not Inception); else a TorchScript file
    "ssl.tasks": "both",
    "ssl.finetune": "flbt",
    "ssl.epochs": 5,
    "ssl.rounds": 5,
    "ssl.lr": 0.001,
    "ssl.swap-patch": 0,
    "ssl.swaps": 10,
    "ssl.fedema": True,  # ssl.pretrain="federated" (FedSSL-R/S): FedEMA's divergence-aware update (004 [67])
}
#: one line per option: the run-config reference (docs/run-config.md)
SSL_DOCS = {
    "ssl.pretrain": "where stage 1 runs: `pseudo` (server, GAN images) | `local` (SSL-Fed) | `federated` (FedSSL)",
    "ssl.pseudo-per-centre": "pseudo images each centre sends (004: 1000)",
    "ssl.gan-steps": "GAN updates (one D and one G step each) per centre",
    "ssl.gan-batch": "GAN batch size",
    "ssl.gan-width": "channels of the GAN's coarsest block (halved per scale, at least 16)",
    "ssl.gan-latent": "GAN latent size",
    "ssl.gan-lr": "Adam learning rate of the GAN's G and D (004 §IV-C)",
    "ssl.fid-select": "rank generator snapshots by FID to the centre's own images and send the best one's images",
    "ssl.fid-checkpoints": "generator snapshots compared, evenly spaced over `ssl.gan-steps`",
    "ssl.fid-keep": "best snapshots whose images are sent, at most `ssl.fid-checkpoints`",
    "ssl.fid-features": '`""`: a fixed random CNN (not Inception-FID); or a TorchScript feature network',
    "ssl.tasks": "pretext tasks: `both` | `centre` | `restoration` on pseudo images; `restoration` | `simclr` "
    "on original images",
    "ssl.finetune": "stage 2: `flbt` | `fedavg` (SSL-FL) | `local` (SSL-L-FT)",
    "ssl.epochs": "server pre-training epochs over the pseudo images (per round and centre with `local`/`federated`)",
    "ssl.rounds": "pre-training rounds with `ssl.pretrain` = `local`/`federated`",
    "ssl.lr": "pre-training learning rate (Adam)",
    "ssl.swap-patch": "side of the swapped patches in px (`0` = image-size/8)",
    "ssl.swaps": "patch pairs swapped per image",
    "ssl.fedema": '`ssl.pretrain="federated"` (FedSSL-R/S): each centre updates its own pre-training network by '
    "FedEMA's divergence-aware EMA of the global one (`fedema.tau`, `fedema.lambda`; 004 [67]); `false`: "
    "plain FedAvg",
}

METHOD = register_method(
    Method(
        "ssl-flbt",
        "strategies.ssl_flbt",
        "clients.ssl_flbt",
        "SSL-FL-BT (paper 004 §III): centres share only MSG-GAN pseudo images; the server pre-trains "
        "the backbone (centre classification + patch-swap restoration); then FL-BT.",
        options=SSL_OPTIONS,
        sends=("arrays", "metrics", "pr-curve", "pseudo-images"),
        messages=("train.gan", "train.pretrain", "train", "evaluate"),
        network="projected",
        model="resnet50",
        paper_image_size=256,
        smallest={"ssl.gan-steps": 5, "ssl.pseudo-per-centre": 8, "ssl.gan-width": 16, "ssl.epochs": 1},
        probe="fedderm.probes:backbone_from_ssl_flbt",
        augment="004",
        docs=SSL_DOCS,
    )
)
