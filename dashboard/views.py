from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from cachebox.store import CacheBox


@login_required
def home(request):
    store = CacheBox(settings.REDIS_URL, connect_timeout=0.3, timeout=1.0)
    return render(
        request,
        "dashboard/home.html",
        {
            "cachebox_up": store.ping(),
            "cachebox_url": store.safe_url,
            "embedded": settings.REDIS_URL_IS_EMBEDDED,
        },
    )
