"""The dashboard's pages, a module each: sidebar() draws the page's own widgets, draw() the page. dashboards/app.py
holds their titles and order, dashboards/widgets.py what every page shares."""
