"""The labelling page in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``)
driven by Selenium, on a copy of conftest's ``served`` data directory with unlabelled images stored. One
question is answered by a click, one by a key; the store has them labelled. A forged POST (no token) is
refused and labels nothing. With labels that are digits, a digit key answers with the label it reads as.

``.ci/run`` installs the browser. Without it the test fails and says what to install; set
``EDGEREV_NO_BROWSER=1`` to skip it on a machine that has none.
"""

from __future__ import annotations

import os
import shutil
import urllib.error
import urllib.parse
import urllib.request

import pytest

from edgerev_daemon.learning import answers, questions
from edgerev_daemon.storage.store import Store
from tests.daemon.learning.test_questions import true_label

pytestmark = pytest.mark.browser

CHROMIUM = ("chromium", "chromium-browser")
DRIVER = "chromedriver"
WAIT = 30.0  # seconds a page may take to load on a loaded machine (a condition is awaited, never a time slept)


def browser():
    """A headless Chromium under Selenium, given the driver's path (Selenium Manager never goes online)."""
    missing = []
    binary = next((p for name in CHROMIUM if (p := shutil.which(name))), None)
    driver = shutil.which(DRIVER) or next((p for p in ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
                                           if os.path.exists(p)), None)
    if binary is None:
        missing.append("chromium")
    if driver is None:
        missing.append("chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (pip install -e '.[dev]')")
    if missing:
        why = f"the browser test needs {', '.join(missing)} (apt-get install -y chromium chromium-driver)"
        if os.environ.get("EDGEREV_NO_BROWSER") == "1":
            pytest.skip(f"EDGEREV_NO_BROWSER=1: {why}")
        pytest.fail(f"{why}; or set EDGEREV_NO_BROWSER=1 to skip it", pytrace=False)
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--no-first-run", "--disable-extensions", "--window-size=1000,1400"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=driver), options=options)


def top_question(driver) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, "form.q input[name=sample]").get_attribute("value")


def wait_past(driver, top: str) -> None:
    """Until the page's top question is another than ``top``: the answer went through and the page reloaded (an
    element found just before the reload goes stale: looked for again)."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, WAIT, ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)).until(
        lambda d: top_question(d) != top)


def test_an_owner_answers_by_click_and_by_key_and_a_forged_post_labels_nothing(label_page):
    from selenium.webdriver.common.by import By

    config, server, truth = label_page
    with Store(config.layout.database) as store:
        labels = store.labels()
        asked = questions.waiting(config.layout.root, store)
        before = store.count_samples(labeled=True)
        first, second = asked[0].sample, asked[1].sample
        answer1, answer2 = true_label(store, truth, first), true_label(store, truth, second)
    driver = browser()
    try:
        driver.get(server.url + "label")
        assert driver.title == "edgerev daemon: questions"
        assert top_question(driver) == first
        # every picture loaded from the device (the CSP admits only this server's images)
        assert driver.execute_script("return Array.from(document.images).every(i => i.complete && i.naturalWidth > 0)")
        # a click on the top question's button for its label
        form = driver.find_element(By.CSS_SELECTOR, "form.q")
        form.find_element(By.CSS_SELECTOR, f'button[name=label][value="{answer1}"]').click()
        wait_past(driver, first)
        assert top_question(driver) == second
        notes = driver.find_element(By.ID, "notes").text
        assert f"labelled '{answer1}'" in notes
        # a key: the label's number answers the (new) top question
        driver.find_element(By.TAG_NAME, "body").send_keys(str(labels.index(answer2) + 1))
        wait_past(driver, second)
    finally:
        driver.quit()
    with Store(config.layout.database) as store:
        assert store.get_sample(first).label == answer1 and store.get_sample(second).label == answer2
        assert store.count_samples(labeled=True) == before + 2
        third = questions.waiting(config.layout.root, store)[0].sample
    # another site's page can send a form but cannot read the token: refused, nothing labelled
    forged = urllib.parse.urlencode({"sample": third, "label": labels[0]}).encode()
    req = urllib.request.Request(server.url + "label", data=forged, method="POST",
                                 headers={"Content-Type": "application/x-www-form-urlencoded"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=10)
    assert refused.value.code == 403
    refused.value.close()
    with Store(config.layout.database) as store:
        assert store.get_sample(third).label is None and store.count_samples(labeled=True) == before + 2


def test_with_digit_labels_the_key_5_answers_5(label_page):
    from selenium.webdriver.common.by import By

    config, server, _ = label_page
    digits = [str(d) for d in range(10)]
    with Store(config.layout.database) as store:  # ten samples labelled 0..9: the store knows them as labels
        given = [answers.Answer(q.sample, d, new_label=True)
                 for q, d in zip(questions.waiting(config.layout.root, store)[-10:], digits, strict=True)]
        assert all(o.ok for o in answers.apply(config, store, given))
        assert store.labels()[-10:] == digits
    driver = browser()
    try:
        driver.get(server.url + "label")
        top = top_question(driver)
        form = driver.find_element(By.CSS_SELECTOR, "form.q")
        badges = {b.get_attribute("value"): b.find_element(By.TAG_NAME, "kbd").text
                  for b in form.find_elements(By.CSS_SELECTOR, "button[name=label][data-key]")}
        assert badges == {d: d for d in digits}  # each digit label's badge reads its own digit
        driver.find_element(By.TAG_NAME, "body").send_keys("5")
        wait_past(driver, top)
    finally:
        driver.quit()
    with Store(config.layout.database) as store:
        assert store.get_sample(top).label == "5"
